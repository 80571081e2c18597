/*
 * A two-turn chat with llmsd through the C library, tokens streamed as they come.
 *
 *   cc -I client/include client/examples/chat.c target/release/libllms_client.a -lpthread -ldl -lm -o chat
 *   ./chat [SOCKET] ["first message" "second message"]
 *
 * SOCKET defaults to llmsd's ($LLMS_SOCKET, ...). Without messages it asks two fixed questions.
 */
#include <stdio.h>
#include <string.h>

#include "llms.h"

/* Each streamed piece goes straight to stdout. */
static int print_piece(const char *piece, size_t len, void *user) {
    (void)user;
    fwrite(piece, 1, len, stdout);
    fflush(stdout);
    return 0; /* non-zero would cancel the call */
}

static int check(LlmsStatus s, const char *what) {
    if (s != LLMS_OK) {
        fprintf(stderr, "chat: %s: %s (%s)\n", what, llms_status_name((int)s), llms_last_error());
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *socket = argc > 1 && argv[1][0] ? argv[1] : NULL;
    const char *turns[2] = {"Name a colour of the sky.", "And at sunset?"};
    if (argc > 3) {
        turns[0] = argv[2];
        turns[1] = argv[3];
    }
    LlmsClient *c = NULL;
    if (check(llms_connect(socket, "c-chat-example", &c), "connect")) return 1;
    char ctx[LLMS_CTX_ID_LEN];
    if (check(llms_new_ctx(c, "You are brief.", ctx, sizeof ctx), "new context")) return 1;
    for (int i = 0; i < 2; i++) {
        printf("> %s\n", turns[i]);
        LlmsCallOptions o = {.ctx = ctx, .prompt = turns[i], .max_tokens = 32, .temperature = 0.0f, .seed = 0, .raw = false};
        if (check(llms_call(c, &o, print_piece, NULL, NULL), "call")) return 1;
        printf("\n");
    }
    check(llms_del_ctx(c, ctx), "delete context");
    llms_close(c);
    return 0;
}

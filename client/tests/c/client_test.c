/*
 * The C library against a live llmsd (run by llmsd/tests/llmsd.rs, which builds and starts
 * both): argument errors, a two-turn conversation whose streamed pieces make its output,
 * llmsd's errors as status codes, cancelling from the callback and from another thread (the
 * handle reconnects after), listing, deleting. Prints "N passed, 0 failed" or fails with a
 * message and exit status 1.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llms.h"

static int passed = 0;
#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);             \
            fprintf(stderr, __VA_ARGS__);                                     \
            fprintf(stderr, " (last error: %s)\n", llms_last_error());       \
            exit(1);                                                          \
        }                                                                     \
        passed++;                                                             \
    } while (0)

struct sink {
    char text[8192];
    size_t len;
    int pieces;
    int stop_after; /* cancel after this many pieces (0: never) */
};

static int collect(const char *piece, size_t len, void *user) {
    struct sink *s = user;
    CHECK(strlen(piece) == len, "a piece is NUL-terminated at its length");
    if (s->len + len < sizeof s->text) {
        memcpy(s->text + s->len, piece, len);
        s->len += len;
        s->text[s->len] = 0;
    }
    s->pieces++;
    return s->stop_after && s->pieces >= s->stop_after;
}

static void *cancel_soon(void *c) {
    usleep(300 * 1000);
    llms_cancel(c);
    return NULL;
}

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: client_test SOCKET");
    const char *sock = argv[1];
    LlmsClient *c = NULL;

    CHECK(llms_connect(sock, NULL, &c) == LLMS_ERR_INVALID_ARGUMENT, "a NULL app is refused");
    CHECK(llms_connect("/nonexistent/llmsd.sock", "a", &c) == LLMS_ERR_CONNECT, "no service there");
    CHECK(strlen(llms_last_error()) > 0, "the error says why");
    CHECK(strcmp(llms_status_name(9999), "unknown status") == 0, "unknown codes are said to be");
    CHECK(llms_connect(sock, "c-test", &c) == LLMS_OK, "connects");

    char ctx[LLMS_CTX_ID_LEN];
    CHECK(llms_new_ctx(c, NULL, ctx, 8) == LLMS_ERR_INVALID_ARGUMENT, "a short id buffer is refused");
    CHECK(llms_new_ctx(c, "You are brief.", ctx, sizeof ctx) == LLMS_OK, "creates a context");
    CHECK(strlen(ctx) == 32, "a 32-digit id");

    /* Two turns: what is streamed is the output. */
    const char *turns[2] = {"What is the capital of Italy?", "And of France?"};
    for (int i = 0; i < 2; i++) {
        struct sink s = {0};
        char *text = NULL;
        LlmsCallOptions o = {.ctx = ctx, .prompt = turns[i], .max_tokens = 16};
        CHECK(llms_call(c, &o, collect, &s, &text) == LLMS_OK, "turn %d", i);
        CHECK(text && strcmp(text, s.text) == 0, "the streamed pieces make the output: '%s' vs '%s'", s.text, text);
        CHECK(s.pieces > 0 && s.len > 0, "pieces were streamed");
        llms_free_string(text);
    }

    /* A fork holds the context's tokens and goes on apart from it. */
    char branch[LLMS_CTX_ID_LEN];
    CHECK(llms_fork(c, ctx, branch, 8) == LLMS_ERR_INVALID_ARGUMENT, "a short id buffer is refused");
    CHECK(llms_fork(c, NULL, branch, sizeof branch) == LLMS_ERR_INVALID_ARGUMENT, "a NULL context is refused");
    CHECK(llms_fork(c, ctx, branch, sizeof branch) == LLMS_OK, "forks the context");
    CHECK(strlen(branch) == 32 && strcmp(branch, ctx) != 0, "a new 32-digit id");
    CHECK(llms_fork(c, "00000000000000000000000000000000", branch, sizeof branch) == LLMS_ERR_NOT_FOUND, "forking an unknown context");
    LlmsCallOptions on_branch = {.ctx = branch, .prompt = "And then?", .max_tokens = 4};
    CHECK(llms_call(c, &on_branch, NULL, NULL, NULL) == LLMS_OK, "the fork answers");

    /* llmsd's own errors come back as codes. */
    LlmsCallOptions bad = {.ctx = "00000000000000000000000000000000", .prompt = "hi", .max_tokens = 4};
    CHECK(llms_call(c, &bad, NULL, NULL, NULL) == LLMS_ERR_NOT_FOUND, "an unknown context");
    LlmsCallOptions zero = {.ctx = ctx, .prompt = "hi", .max_tokens = 0};
    CHECK(llms_call(c, &zero, NULL, NULL, NULL) == LLMS_ERR_BAD_REQUEST, "max_tokens 0");

    /* Cancelled by the callback, then by another thread; the handle goes on after each. */
    LlmsCallOptions count = {.ctx = ctx, .prompt = "1, 2, 3, 4, 5, 6, 7, 8,", .max_tokens = 200, .raw = true};
    struct sink s = {.stop_after = 3};
    CHECK(llms_call(c, &count, collect, &s, NULL) == LLMS_ERR_CANCELLED, "the callback cancels");
    struct sink s2 = {0};
    pthread_t t;
    pthread_create(&t, NULL, cancel_soon, c);
    CHECK(llms_call(c, &count, collect, &s2, NULL) == LLMS_ERR_CANCELLED, "another thread cancels");
    pthread_join(t, NULL);
    CHECK(s2.pieces < 200, "the cancelled call stopped early (%d pieces)", s2.pieces);
    LlmsCallOptions after = {.ctx = ctx, .prompt = "Still there?", .max_tokens = 4};
    CHECK(llms_call(c, &after, NULL, NULL, NULL) == LLMS_OK, "the handle reconnects after a cancel");

    char *json = NULL;
    CHECK(llms_list_json(c, &json) == LLMS_OK && strstr(json, ctx), "the context is listed");
    llms_free_string(json);
    CHECK(llms_del_ctx(c, ctx) == LLMS_OK, "deletes");
    CHECK(llms_call(c, &after, NULL, NULL, NULL) == LLMS_ERR_NOT_FOUND, "a deleted context is gone");
    llms_close(c);
    printf("%d passed, 0 failed\n", passed);
    return 0;
}

#!/usr/bin/env python3
"""llama.cpp's batched decoding through llama-cpp-python's low-level API, measured the way
`llms bench-batch` measures ours: for each B, B sequences of `depth` tokens (different text:
token ids from one fixed recurrence, each sequence offset by 7), then `tokens` steps that each
decode one token for every sequence in one llama_decode call (one forward pass), the next token
the argmax of that sequence's logits; the median over `reps` of the step time and of the
aggregate tokens/s, and both against B = 1 in the same run. f16 KV cache (llama.cpp's default,
as `llms bench-batch`'s sessions), flash attention as llama.cpp chooses, one context holding all
B sequences (a unified cache: llama-server's own layout).

usage: llama_cpp_batch.py MODEL THREADS DEPTH TOKENS REPS B [B ...]   (prints JSON)"""
import ctypes, json, statistics, sys, time

import llama_cpp as L
import numpy as np

model_path, threads, depth, tokens, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
sizes = [int(b) for b in sys.argv[6:]] or [1, 8]

# llama.cpp logs every tensor it loads to stderr: keep it quiet (errors still exit non-zero).
@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level, text, user):
    pass


L.llama_log_set(_quiet, None)
L.llama_backend_init()
mp = L.llama_model_default_params()
model = L.llama_model_load_from_file(model_path.encode(), mp)
if not model:
    sys.exit(f"llama.cpp could not load {model_path}")
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
text = [((i * 2654435761) % 2**32 >> 7) % vocab for i in range(depth + 7 * max(sizes) + 8)]


def run(b):
    cp = L.llama_context_default_params()
    cp.n_ctx = b * (depth + tokens + 8)
    cp.n_batch = max(depth, b)
    cp.n_ubatch = max(depth, b)
    cp.n_seq_max = b
    cp.n_threads = threads
    cp.n_threads_batch = threads
    cp.kv_unified = True
    # LLAMA_FLASH_ATTN_TYPE_AUTO, llama.cpp's default and its faster batch here (a step of 8
    # contexts 4.6x its one context's against 5.5x with it off, one run).
    cp.flash_attn_type = -1
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        sys.exit("llama.cpp could not make a context")
    batch = L.llama_batch_init(max(depth, b), 0, b)

    def fill(items):
        # items: (token, pos, seq, wants logits)
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if out else 0
        if L.llama_decode(ctx, batch) != 0:
            sys.exit("llama_decode failed")

    def argmax(i):
        # The logits row read whole by numpy (a Python loop over the vocabulary would be timed).
        row = L.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), shape=(vocab,)).argmax())

    steps, rates = [], []
    for _ in range(reps):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        nxt = []
        for s in range(b):
            seq = text[7 * s:7 * s + depth]
            fill([(t, p, s, p == depth - 1) for p, t in enumerate(seq)])
            nxt.append(argmax(-1))
        t0 = time.perf_counter()
        for k in range(tokens):
            fill([(nxt[s], depth + k, s, True) for s in range(b)])
            nxt = [argmax(s) for s in range(b)]
        secs = time.perf_counter() - t0
        steps.append(secs * 1000 / tokens)
        rates.append(b * tokens / secs)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    return statistics.median(rates), statistics.median(steps)


rows = []
for b in sizes:
    rate, step = run(b)
    rows.append({"batch": b, "aggregate_tok_s": rate, "step_ms": step})
one = next((r for r in rows if r["batch"] == 1), None)
for r in rows:
    r["vs_one"] = r["aggregate_tok_s"] / one["aggregate_tok_s"] if one else None
    r["step_vs_one"] = r["step_ms"] / one["step_ms"] if one else None
L.llama_model_free(model)
print(json.dumps({"threads": threads, "depth": depth, "tokens": tokens, "reps": reps, "rows": rows}))

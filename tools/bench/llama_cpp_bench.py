#!/usr/bin/env python3
"""llama.cpp's pp/tg speed through llama-cpp-python, measured the way `llms bench` measures ours:
pp = one prompt of N tokens evaluated as one batch; tg = M tokens decoded one at a time from an
empty context; a warm-up, then `reps` repetitions; prints JSON with the medians."""
import json, statistics, sys, time
from llama_cpp import Llama

model, threads, pp, tg, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = Llama(model_path=model, n_ctx=pp + tg, n_batch=pp, n_ubatch=pp, n_threads=threads, n_threads_batch=threads, verbose=False)
vocab = llm.n_vocab()
prompt = [((i * 2654435761) % 2**32 >> 7) % vocab for i in range(pp)]
pps, tgs = [], []
for rep in range(reps + 1):
    llm.reset()
    t = time.perf_counter(); llm.eval(prompt); pp_s = time.perf_counter() - t
    llm.reset()
    tok = prompt[0]
    t = time.perf_counter()
    for _ in range(tg):
        llm.eval([tok])
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
    tg_s = time.perf_counter() - t
    if rep > 0:
        pps.append(pp / pp_s); tgs.append(tg / tg_s)
print(json.dumps({f"pp{pp}_tok_s": statistics.median(pps), f"tg{tg}_tok_s": statistics.median(tgs), "threads": threads}))

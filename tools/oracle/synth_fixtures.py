#!/usr/bin/env python3
"""Generates tests/fixtures/synth.json: llama.cpp's logits on random-weight models of each
architecture the engine runs, written by `llms synth` (tools/src/synth.rs).

Each case is a small model (2-3 layers, the default model's tokenizer) that differs from the
default model in what an architecture changes: GQA ratio (1, 2, 3, 4, 8), RoPE mode (llama's
adjacent pairs, qwen2's neox halves), Llama 3's frequency factors, linear RoPE scaling, Q/K/V
biases, tied or separate output, and the weight types (f32, f16, q8_0, q4_0, the q4_k_m
mix of Q4_K / Q6_K with its Q5_0 / Q8_0 fallbacks, and the q5_k_m mix of Q5_K / Q6_K with its
Q5_1 / Q8_0 fallbacks). For every prompt: llama.cpp's tokens and
the top 10 of its last-position logits. The test (tools/tests/synth.rs) rewrites each file
from the recorded shape and seed, checks its SHA-256 equals the one recorded here (the
generator is deterministic), and compares the engine's logits.

Usage: synth_fixtures.py LLMS_BINARY WORKDIR OUT_JSON
"""
import hashlib, json, subprocess, sys

import numpy as np
from llama_cpp import Llama

llms, workdir, out_path = sys.argv[1:4]

# name, llms synth flags
CASES = [
    ("llama-mha-f32", "--layers 2 --dim 256 --heads 4 --kv-heads 4 --ffn 512 --rope-base 10000 --type f32"),
    ("llama-gqa3-f16", "--layers 2 --dim 384 --heads 6 --kv-heads 2 --ffn 1024 --type f16"),
    ("mistral-gqa4-q8_0", "--like mistral-7b --layers 2 --dim 512 --heads 8 --kv-heads 2 --ffn 1024 --ctx 4096 --type q8_0"),
    ("llama3-gqa4-f32", "--like llama3-8b --layers 2 --dim 512 --heads 4 --kv-heads 1 --ffn 1024 --ctx 8192 --tied true --type f32"),
    ("llama-linear-rope-f16", "--layers 2 --dim 256 --heads 4 --kv-heads 2 --ffn 512 --rope-scale 4 --tied false --type f16"),
    ("llama-gqa2-q4_0", "--layers 2 --dim 256 --heads 4 --kv-heads 2 --ffn 512 --tied false --type q4_0"),
    ("llama-q4_k_m", "--layers 3 --dim 512 --heads 8 --kv-heads 8 --ffn 768 --tied false --type q4_k_m"),
    ("llama-q5_k_m", "--layers 3 --dim 512 --heads 8 --kv-heads 8 --ffn 768 --tied false --type q5_k_m"),
    # SmolLM2's widths: 576-wide rows fall back to Q5_1 (Q8_0 for the Q6_K ones), ffn_down is Q5_K / Q6_K.
    ("smollm2-q5_k_m", "--layers 2 --dim 576 --heads 9 --kv-heads 3 --ffn 1536 --type q5_k_m"),
    ("qwen2-gqa2-q8_0", "--like qwen2-1.5b --layers 2 --dim 256 --heads 4 --kv-heads 2 --ffn 512 --ctx 4096 --type q8_0"),
    ("qwen2-gqa8-f32", "--like qwen2-1.5b --layers 2 --dim 512 --heads 8 --kv-heads 1 --ffn 512 --ctx 4096 --tied false --type f32"),
]

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about memory.<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    # ~400 tokens: positions far enough for the low-frequency pairs that Llama 3's factors
    # and linear scaling change to turn by whole radians.
    " ".join(f"Line {i}: the service keeps contexts of many apps alive in a small memory budget, "
             f"and switches between them fast." for i in range(20)),
]

cases = []
for name, flags in CASES:
    path = f"{workdir}/{name}.gguf"
    info = json.loads(subprocess.check_output([llms, "synth", "--out", path, "--seed", "7", "--json", *flags.split()]))
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    llm = Llama(model_path=path, n_ctx=512, n_threads=2, logits_all=True, verbose=False, seed=0)
    prompts = []
    for p in PROMPTS:
        ids = llm.tokenize(p.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        last = np.array(llm.scores[len(ids) - 1], dtype=np.float64)
        top = np.argsort(-last, kind="stable")[:10]
        prompts.append({"prompt": p, "tokens": ids, "top": [{"id": int(i), "logit": float(last[i])} for i in top]})
    del llm
    cases.append({"name": name, "flags": flags, "shape": info["shape"], "type": info["type"], "seed": info["seed"],
                  "sha256": sha, "prompts": prompts})
    print(name, "top-1:", [c["top"][0]["id"] for c in prompts], file=sys.stderr)

out = {"llama_cpp_python": __import__("llama_cpp").__version__, "cases": cases}
with open(out_path, "w") as f:
    json.dump(out, f, indent=1, ensure_ascii=False)
    f.write("\n")

#!/usr/bin/env python3
"""Generates tests/fixtures/llama_cpp.json with llama.cpp (through llama-cpp-python) as the oracle.

How the fixtures were made (run `make fixtures`, which calls this through make_fixtures.sh):
  - tokenization: llama.cpp's tokenizer (`Llama.tokenize(text, add_bos=False, special=True)`)
    on a set of varied texts (code, unicode, emoji, digits, whitespace runs, chat markup);
  - logits: the last-position logits of several prompts, top 10 (id, logit);
  - greedy: 32 tokens of greedy continuation per prompt (temperature 0);
  - perplexity: llama.cpp's method (windows of N tokens, score the second half of each) on
    the public text given (the GPL-3 text shipped by Debian in /usr/share/common-licenses),
    computed from llama.cpp's logits for every position.
  - kv_perplexity: the peer column of the KV-compression accuracy table (docs/kv.md): the
    same method at 512-token windows, every whole window of each accuracy text (the GPL-3
    text and tests/fixtures/heapq.py.txt, Python's heapq module), with llama.cpp's own KV
    cache at f16, q8_0 and q4_0 (`type_k`/`type_v`, flash attention on, as llama.cpp needs
    for a quantized V cache).
The model file's SHA-256 is recorded so a test never compares against another model's values.
"""
import hashlib, json, math, sys

import numpy as np
from llama_cpp import Llama

model_path, text_path, out_path = sys.argv[1:4]
KV_TEXTS = sys.argv[4:] or [text_path]
PPL_CTX, PPL_CHUNKS = 256, 6
KV_CTX = 512

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and   runs of    spaces\t\ttabs\n\nnewlines\n",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Numbers: 0 12 345 6789 3.14159 1,000,000 and 2024-11-22T10:30:00Z",
    "Unicode: naïve café résumé Ünïcödé — “quotes” ‘single’ … ½ ¾ ∑ ∫ √",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "Emoji: 🦀🚀 👩‍💻 👍🏽 ❤️ 🇫🇷",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "It's, we're, they'll, I'd, you've, she's — contractions'n'quotes'",
    "   ",
    "\n",
    "a\n\n\nb \n c  \n  d",
    "x=1;y=2;print(x+y)  # comment with <|endoftext|> inside",
    "Ελληνικά και русский текст, עברית, العربية",
    "",
]

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about memory.<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
]

# Gemma 3 (FIXTURE_SET=gemma3, `make fixtures` writes tests/fixtures/gemma3.json): its turn
# markup and user-defined pieces (runs of newlines, spaces and tabs, HTML tags), text that
# spells its control tokens, more scripts; and a prompt longer than its 512-token sliding
# window, so the local layers' window is checked, not only a short context.
import os
if os.environ.get("FIXTURE_SET") == "gemma3":
    TEXTS += [
        "<start_of_turn>user\nWrite a haiku about memory.<end_of_turn>\n<start_of_turn>model\n",
        "<bos><eos><pad><unk><mask><unused0><unused6241>[multimodal]<start_of_image>",
        "\n\n\n\n" + " " * 40 + "\t\t\t</div><li>x</li>\n" * 3,
        "हिन्दी, বাংলা, தமிழ், ไทย, ქართული, Հայերեն, አማርኛ",
        "zero\u200bwidth\u00a0nbsp\u3000ideographic\u2028line\u0000nul\u0007bell\x7f",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "▁pre▁escaped▁ spaces ▁",
    ]
    PROMPTS = [
        "The capital of France is",
        "<start_of_turn>user\nWrite a haiku about memory.<end_of_turn>\n<start_of_turn>model\n",
        "def add(a, b):\n    ",
        "Once upon a time, in a small village by the sea,",
        "1, 2, 3, 4, 5,",
        open(text_path, encoding="utf-8").read()[:4000],
    ]

sha = hashlib.sha256(open(model_path, "rb").read()).hexdigest()
llm = Llama(model_path=model_path, n_ctx=2048, n_threads=2, logits_all=True, verbose=False, seed=0)

# Where the model adds BOS (Gemma does; SmolLM2 does not) prompts start with it, and llama.cpp's
# perplexity method puts it first in each window: without it Gemma's perplexity is 2.5x higher.
BOS = llm.token_bos() if llm.metadata.get("tokenizer.ggml.add_bos_token") == "true" else None
def with_bos(win):
    return [BOS] + win[1:] if BOS is not None else win

def tok(text, special=True):
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)

out = {"model_sha256": sha, "llama_cpp_python": __import__("llama_cpp").__version__}
out["tokenize"] = [{"text": t, "ids": tok(t)} for t in TEXTS]

logits_cases, greedy_cases = [], []
for p in PROMPTS:
    ids = ([BOS] if BOS is not None else []) + tok(p)
    llm.reset()
    llm.eval(ids)
    last = np.array(llm.scores[len(ids) - 1], dtype=np.float64)
    top = np.argsort(-last, kind="stable")[:10]
    logits_cases.append({"prompt": p, "tokens": ids, "top": [{"id": int(i), "logit": float(last[i])} for i in top]})
    gen = []
    cur = int(top[0])
    for _ in range(32):
        if cur == llm.token_eos() or cur == 2:
            break
        gen.append(cur)
        llm.eval([cur])
        cur = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    greedy_cases.append({"prompt": p, "tokens": gen})
out["logits"] = logits_cases
out["greedy"] = greedy_cases

text = open(text_path, encoding="utf-8").read()
ids = tok(text, special=False)
nll, count = 0.0, 0
for c in range(min(PPL_CHUNKS, len(ids) // PPL_CTX)):
    win = with_bos(ids[c * PPL_CTX:(c + 1) * PPL_CTX])
    llm.reset()
    llm.eval(win)
    for i in range(PPL_CTX // 2, PPL_CTX - 1):
        row = np.array(llm.scores[i], dtype=np.float64)
        m = row.max()
        lse = math.log(np.exp(row - m).sum()) + m
        nll += lse - row[win[i + 1]]
        count += 1
out["perplexity"] = {"text": "GPL-3 (/usr/share/common-licenses/GPL-3)", "ctx": PPL_CTX, "chunks": PPL_CHUNKS, "ppl": math.exp(nll / count), "scored": count}

def window_nll(model, win):
    """Summed negative log-likelihood of a window's second half, and how many were scored."""
    model.reset()
    model.eval(win)
    nll, count = 0.0, 0
    for i in range(len(win) // 2, len(win) - 1):
        row = np.array(model.scores[i], dtype=np.float64)
        m = row.max()
        nll += math.log(np.exp(row - m).sum()) + m - row[win[i + 1]]
        count += 1
    return nll, count

import llama_cpp
kv_rows = []
for kv_name, kv_type in [("f16", llama_cpp.GGML_TYPE_F16), ("q8_0", llama_cpp.GGML_TYPE_Q8_0), ("q4_0", llama_cpp.GGML_TYPE_Q4_0)]:
    peer = Llama(model_path=model_path, n_ctx=KV_CTX, n_batch=KV_CTX, n_threads=2, logits_all=True, verbose=False, seed=0,
                 flash_attn=True, type_k=kv_type, type_v=kv_type)
    for path in KV_TEXTS:
        kv_ids = tok(open(path, encoding="utf-8").read(), special=False)
        nll, count = 0.0, 0
        for c in range(len(kv_ids) // KV_CTX):
            a, b = window_nll(peer, with_bos(kv_ids[c * KV_CTX:(c + 1) * KV_CTX]))
            nll += a
            count += b
        kv_rows.append({"text": path.split("/")[-1], "ctx": KV_CTX, "windows": len(kv_ids) // KV_CTX, "kv": kv_name,
                        "flash_attn": True, "ppl": math.exp(nll / count), "scored": count})
    del peer
out["kv_perplexity"] = kv_rows

with open(out_path, "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False, indent=1)
print(f"wrote {out_path}: {len(TEXTS)} texts, {len(PROMPTS)} prompts, ppl {out['perplexity']['ppl']:.4f}")
for r in kv_rows:
    print(f"  llama.cpp KV {r['kv']:5} {r['text']}: ppl {r['ppl']:.4f} ({r['windows']} windows of {r['ctx']})")

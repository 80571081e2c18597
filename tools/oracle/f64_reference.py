#!/usr/bin/env python3
"""An exact forward pass in float64 (numpy), to measure how far each engine's logits are from the
model the file defines: llms and llama.cpp both quantize activations to 8 bits before their
matmuls, so neither is "the answer"; this is.

Each weight is dequantized by gguf-py (llama.cpp's own Python package) and held in float64; every
activation, norm, RoPE angle, softmax and residual is float64; nothing is rounded to 8 or 16 bits.
Architectures: `llama` (SmolLM2) and `gemma3` (Gemma 3 270M: sqrt(dim)-scaled embeddings, Q/K
head norms, post norms, GELU(tanh), interleaved sliding window, local RoPE base 10k).

Usage: f64_reference.py MODEL.gguf OUT.json [--llms BIN] [--emulate-acts] [--noise-runs N]

Scored: the last position of 7 prompts and every position of the first 600 characters of the
two accuracy texts (GPL-3, heapq.py): f64's top-10 next-token logits there, llama.cpp's
(llama-cpp-python) and llms's (`BIN logits --all-positions`) for the same token ids. The summary
is each engine's root mean square of (logit - f64) over those, the largest gap, and how often
its top-1 is f64's. OUT.json keeps every scored position (`make fixtures` writes the test
fixtures tests/fixtures/f64_*.json with it; engine/tests/llama_cpp_oracle.rs adds llms's column).
`--emulate-acts` adds a third row: f64 with the activations rounded exactly as llama.cpp's CPU
backend does before each matmul (Q8_0 blocks of 32 with an f16 scale for Q4_0/Q5_0/Q8_0 weights
and Q8_1 for Q4_1/Q5_1 — the same codes; Q8_1's f16-rounded block sum is not emulated —, Q8_K
blocks of 256 with an f32 scale for the K-quants, f16 for F16) —
so a gap can be attributed to activation rounding per weight type (`--acts-only TYPE,...`
rounds only before matmuls of those types).
"""
import argparse, hashlib, json, math, os, subprocess, sys, tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "The mitochondria is the powerhouse of the cell. In plants, photosynthesis",
    "import numpy as np\n\ndef softmax(x):\n    e = np.exp(x - x.max())\n    return",
]
CHAT = {
    "llama": "<|im_start|>user\nWrite a haiku about memory.<|im_end|>\n<|im_start|>assistant\n",
    "gemma3": "<start_of_turn>user\nWrite a haiku about memory.<end_of_turn>\n<start_of_turn>model\n",
}


def field(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    v = f.parts[f.data[0]]
    if f.types and f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(v).decode()
    return v.tolist()[0] if len(v) == 1 else v.tolist()


class Weights:
    """Tensors dequantized to float64 on first use, with their GGML type."""

    def __init__(self, reader):
        self.t = {t.name: t for t in reader.tensors}
        self.cache = {}

    def __contains__(self, name):
        return name in self.t

    def type(self, name):
        return self.t[name].tensor_type

    def __getitem__(self, name):
        if name not in self.cache:
            t = self.t[name]
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            self.cache[name] = np.asarray(a, dtype=np.float64).reshape([int(n) for n in reversed(t.shape)] if len(t.shape) > 1 else -1)
        return self.cache[name]


# ---- activation rounding as llama.cpp's CPU backend does it (--emulate-acts) -----------------

def f16(x):
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def round_q8_0(x):
    """Q8_0 / Q8_1: blocks of 32, d = amax/127 rounded to f16, codes round(x * 127/amax)."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(b).max(axis=2, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        idv = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
    q = np.clip(np.rint(b * idv), -127, 127)
    return (q.astype(np.float64) * f16(d)).reshape(x.shape)


def round_q8_k(x):
    """Q8_K: blocks of 256, iscale = -128/max (max = the value of largest magnitude), f32 scale."""
    b = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    idx = np.abs(b).argmax(axis=2)[..., None]
    mx = np.take_along_axis(b, idx, axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, np.float32(-128) / mx, np.float32(0))
        q = np.minimum(np.rint(iscale * b), 127)
        d = np.where(mx != 0, np.float32(1) / iscale, np.float32(0))
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


# Row names (JSON keys, also in links from the docs): the engines, then f64 with llama.cpp's
# activation rounding (`emulated`), the same with jitter (`jitter_N`), rounding one type only.
EMU = "emulated"
K_TYPES = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
Q8_TYPES = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}


class Model:
    def __init__(self, path, emulate=None, jitter_seed=None):
        self.r = gguf.GGUFReader(path)
        self.arch = field(self.r, "general.architecture")
        if self.arch not in ("llama", "gemma3"):
            sys.exit(f"f64_reference: architecture {self.arch!r} is not implemented")
        a = self.arch
        self.n_layer = field(self.r, f"{a}.block_count")
        self.dim = field(self.r, f"{a}.embedding_length")
        self.n_head = field(self.r, f"{a}.attention.head_count")
        self.n_kv = field(self.r, f"{a}.attention.head_count_kv", self.n_head)
        self.hd = field(self.r, f"{a}.attention.key_length", self.dim // self.n_head)
        self.eps = field(self.r, f"{a}.attention.layer_norm_rms_epsilon")
        self.base = field(self.r, f"{a}.rope.freq_base", 10000.0)
        self.rope_scale = 1.0 / field(self.r, f"{a}.rope.scaling.factor", 1.0)
        self.window = field(self.r, f"{a}.attention.sliding_window", 0)
        self.w = Weights(self.r)
        self.emulate = emulate  # None, or the set of weight types whose activations are rounded
        # A relative jitter of ~1 f32 ulp before each rounding: another engine with the same
        # rounding scheme but another float summation order (--noise-runs).
        self.jitter = np.random.default_rng(jitter_seed) if jitter_seed is not None else None

    def mm(self, x, name):
        """x @ W^T with W (out, in), activations rounded as llama.cpp would when emulating."""
        ty = self.w.type(name)
        if self.emulate is not None and ty in self.emulate:
            if self.jitter is not None:
                x = x * (1.0 + self.jitter.normal(0.0, 2.0 ** -23, x.shape))
            if ty in K_TYPES:
                x = round_q8_k(x)
            elif ty in Q8_TYPES:
                x = round_q8_0(x)
            elif ty == T.F16:
                x = f16(x)
        return x @ self.w[name].T

    def rms(self, x, wname):
        y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps)
        return y * self.w[wname]

    def rope(self, x, pos, base, scale, neox):
        """x: (tokens, heads, hd); angle of pair i at position p: p * scale * base^(-2i/hd)."""
        half = self.hd // 2
        inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / self.hd)
        ang = (pos[:, None] * scale) * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        if neox:
            a, b = x[..., :half], x[..., half:]
            return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out

    def forward(self, ids, all_positions=False):
        """Logits (float64) at the last position, or at every position (tokens, vocab)."""
        n = len(ids)
        gemma = self.arch == "gemma3"
        x = self.w["token_embd.weight"][ids]
        if gemma:
            x = x * math.sqrt(self.dim)
        pos = np.arange(n, dtype=np.float64)
        q_scale = 1.0 / math.sqrt(self.hd)
        for l in range(self.n_layer):
            p = f"blk.{l}."
            local = gemma and self.window and (l + 1) % 6 != 0
            h = self.rms(x, p + "attn_norm.weight")
            q = self.mm(h, p + "attn_q.weight").reshape(n, self.n_head, self.hd)
            k = self.mm(h, p + "attn_k.weight").reshape(n, self.n_kv, self.hd)
            v = self.mm(h, p + "attn_v.weight").reshape(n, self.n_kv, self.hd)
            if gemma:
                q = self.rms(q, p + "attn_q_norm.weight")
                k = self.rms(k, p + "attn_k_norm.weight")
                base, scale = (10000.0, 1.0) if local else (self.base, self.rope_scale)
            else:
                base, scale = self.base, self.rope_scale
            q = self.rope(q, pos, base, scale, neox=gemma)
            k = self.rope(k, pos, base, scale, neox=gemma)
            group = self.n_head // self.n_kv
            att = np.empty((n, self.n_head, self.hd))
            qi, kj = np.arange(n)[:, None], np.arange(n)[None, :]
            masked = kj > qi
            if local:
                masked = masked | (qi - kj >= self.window)
            for hh in range(self.n_head):
                kv = hh // group
                sc = (q[:, hh, :] @ k[:, kv, :].T) * q_scale
                sc = np.where(masked, -np.inf, sc)
                sc = np.exp(sc - sc.max(axis=1, keepdims=True))
                sc /= sc.sum(axis=1, keepdims=True)
                att[:, hh, :] = sc @ v[:, kv, :]
            o = self.mm(att.reshape(n, -1), p + "attn_output.weight")
            if gemma:
                o = self.rms(o, p + "post_attention_norm.weight")
            x = x + o
            h = self.rms(x, p + "ffn_norm.weight")
            g = self.mm(h, p + "ffn_gate.weight")
            u = self.mm(h, p + "ffn_up.weight")
            if gemma:
                act = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
            else:
                act = g / (1.0 + np.exp(-g))
            f = self.mm(act * u, p + "ffn_down.weight")
            if gemma:
                f = self.rms(f, p + "post_ffw_norm.weight")
            x = x + f
        h = self.rms(x if all_positions else x[-1:], "output_norm.weight")
        out = "output.weight" if "output.weight" in self.w else "token_embd.weight"
        logits = self.mm(h, out)
        return logits if all_positions else logits[0]


def llms_logits(llms, model_path, prompt, ids, top):
    """llms's `top` highest logits at every position of `prompt`, as {id: logit} per position."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
        path = f.name
    try:
        out = subprocess.run([llms, "logits", "--prompt-file", path, "--top", str(top), "--all-positions", "--model", model_path],
                             check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    j = json.loads(out)
    if j["tokens"] != ids:
        sys.exit(f"f64_reference: llms tokenized {prompt!r} as {j['tokens']}, llama.cpp as {ids}")
    return [{e["id"]: e["logit"] for e in p} for p in j["positions"]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out", help="the result (and test fixture): every scored position's f64 and llama.cpp logits")
    ap.add_argument("--llms", help="an llms binary: adds its column (`llms logits --all-positions`)")
    ap.add_argument("--texts", nargs="*", default=["tests/fixtures/gpl-3.txt", "tests/fixtures/heapq.py.txt"],
                    help="texts whose first --text-chars characters are scored at every position")
    ap.add_argument("--text-chars", type=int, default=600)
    ap.add_argument("--emulate-acts", action="store_true")
    ap.add_argument("--acts-only", default="", help="comma-separated GGML type names (Q5_0,Q4_K,...)")
    ap.add_argument("--attribute", action="store_true",
                    help="one more emulation per weight type in the file, rounding only before that type's matmuls: "
                         "which type's activation rounding moves the logits how much")
    ap.add_argument("--noise-runs", type=int, default=0,
                    help="also run the emulation this many times with ~1 ulp of jitter before each rounding: the spread "
                         "two engines with the same rounding scheme show by float summation order alone")
    args = ap.parse_args()

    from llama_cpp import Llama
    ref = Model(args.model)
    llm = Llama(model_path=args.model, n_ctx=2048, n_threads=2, verbose=False, seed=0, logits_all=True)
    bos = [llm.token_bos()] if field(ref.r, "tokenizer.ggml.add_bos_token") else []
    emus = {}
    if args.emulate_acts or args.noise_runs or args.attribute:
        types = {T[s] for s in args.acts_only.split(",")} if args.acts_only else K_TYPES | Q8_TYPES | {T.F16}
        emus[EMU] = Model(args.model, emulate=types)
        for seed in range(args.noise_runs):
            emus[f"jitter_{seed}"] = Model(args.model, emulate=types, jitter_seed=seed)
    if args.attribute:
        # The types of the matrices a forward pass multiplies by (norms are F32 vectors).
        used = sorted({t.tensor_type for t in ref.r.tensors if len(t.shape) > 1 and t.tensor_type in K_TYPES | Q8_TYPES | {T.F16}},
                      key=lambda t: t.name)
        for ty in used:
            emus[f"only_{ty.name}"] = Model(args.model, emulate={ty})
    for m in emus.values():
        m.w = ref.w  # the same dequantized tensors
    names = ["llama_cpp"] + (["llms"] if args.llms else []) + list(emus)
    # Prompts are scored at their last position, texts at every position: (text, every position?)
    work = [(p, False) for p in PROMPTS + [CHAT[ref.arch]]]
    work += [(open(t, encoding="utf-8").read()[:args.text_chars], True) for t in args.texts]
    diffs = {k: [] for k in names}
    top1 = {k: 0 for k in names}
    missing, scored, cases = 0, 0, []
    for text, every in work:
        ids = bos + llm.tokenize(text.encode(), add_bos=False, special=True)
        exact = ref.forward(ids, all_positions=True)
        llm.reset()
        llm.eval(ids)
        cpp = np.asarray(llm.scores[:len(ids)], dtype=np.float64)
        mine = llms_logits(args.llms, args.model, text, ids, 100) if args.llms else None
        emulated = {k: m.forward(ids, all_positions=True) for k, m in emus.items()}
        positions = range(len(bos), len(ids)) if every else [len(ids) - 1]
        case = {"text": text[:60], "tokens": ids, "positions": len(positions), "rms": {}, "scored": []}
        local = {k: [] for k in names}
        for i in positions:
            top = np.argsort(-exact[i], kind="stable")[:10]
            got = {"llama_cpp": cpp[i][top]}
            if mine:
                got["llms"] = np.array([mine[i].get(int(t), np.nan) for t in top])
                missing += int(np.isnan(got["llms"]).sum())
                top1["llms"] += int(max(mine[i], key=mine[i].get) == top[0])
            for k, e in emulated.items():
                got[k] = e[i][top]
            case["scored"].append({"pos": i, "ids": top.tolist(), "f64": [round(float(x), 5) for x in exact[i][top]],
                                   "llama_cpp": [round(float(x), 5) for x in cpp[i][top]]})
            scored += 1
            for k, v in got.items():
                d = v - exact[i][top]
                local[k].extend(d[~np.isnan(d)].tolist())
            top1["llama_cpp"] += int(np.argmax(cpp[i]) == top[0])
            for k, e in emulated.items():
                top1[k] += int(np.argmax(e[i]) == top[0])
        for k in names:
            diffs[k].extend(local[k])
            case["rms"][k] = math.sqrt(np.mean(np.square(local[k])))
        cases.append(case)
        print(f"{text[:36]!r:40} {len(positions):4} pos  " + "  ".join(f"{k}: {v:.3f}" for k, v in list(case["rms"].items())[:3]), file=sys.stderr)
    # The prompts alone (last positions): few logits, so a wide spread between runs (see jitter).
    last = [c for c in cases if c["positions"] == 1]
    summary = {k: {"rms": math.sqrt(np.mean(np.square(d))), "max": float(np.max(np.abs(d))), "top1_equal": top1[k],
                   "prompts_rms": math.sqrt(sum(c["rms"][k] ** 2 for c in last) / len(last))} for k, d in diffs.items()}
    out = {"model": os.path.basename(args.model), "model_sha256": hashlib.sha256(open(args.model, "rb").read()).hexdigest(),
           "positions": scored, "llms_missing": missing, "summary": summary, "cases": cases}
    if args.acts_only:
        out["rounded_types"] = args.acts_only.split(",")
    if args.noise_runs:
        spread = sorted(summary[k]["rms"] for k in emus if k.startswith("jitter_"))
        out["jitter_rms"] = {"min": spread[0], "median": spread[len(spread) // 2], "max": spread[-1], "runs": len(spread)}
        spread = sorted(summary[k]["prompts_rms"] for k in emus if k.startswith("jitter_"))
        out["jitter_prompts_rms"] = {"min": spread[0], "median": spread[len(spread) // 2], "max": spread[-1], "runs": len(spread)}
    with open(args.out, "w") as f:
        json.dump(out, f)
    # The last line for `llms record`: everything but the per-position values.
    print(json.dumps({k: v for k, v in out.items() if k != "cases"} | {"cases": [{k: v for k, v in c.items() if k not in ("scored", "tokens")} for c in cases]}))
    for k, s in summary.items():
        print(f"{k:40} top-10 logit RMS vs f64 {s['rms']:.3f}  max {s['max']:.3f}  top-1 equal {s['top1_equal']}/{scored}", file=sys.stderr)
    if missing:
        print(f"{missing} of f64's top-10 logits were not in llms's top 100 (left out)", file=sys.stderr)


if __name__ == "__main__":
    main()

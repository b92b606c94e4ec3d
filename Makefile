# anneal: top-level entry points. `make demo` and `make test` set everything up
# (Debian packages via scripts/bootstrap.sh) and run; the rest are for developers.
BUILD      ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
# Seconds each libFuzzer harness runs in `make test` (tests/fuzz, issue 16).
FUZZ_SECONDS ?= 15
JOBS       ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all build demo test test-asan test-fuzz test-fast bootstrap fixtures bench bench-train bench-torch clean

all: build

bootstrap:
	@bash scripts/bootstrap.sh
	@bash scripts/pyenv.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# Trains a small GPT-2 on the King James Bible for a few minutes (val loss falling),
# then generates a passage (scripts/demo.sh; choices explained in README.md).
demo: bootstrap build
	BUILD=$(BUILD) bash scripts/demo.sh

# The test suite (Release build), then the same suite under ASan + UBSan, then each
# fuzz harness for FUZZ_SECONDS under libFuzzer + ASan + UBSan (clang).
test: bootstrap build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)
	$(MAKE) test-asan
	$(MAKE) test-fuzz

test-fast: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

test-asan:
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DANNEAL_SANITIZE=ON $(CMAKE_FLAGS)
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --test-dir $(ASAN_BUILD) --output-on-failure -j $(JOBS)

# libFuzzer harnesses (tests/fuzz/fuzz_*.c): the library built by clang with ASan, UBSan
# and fuzzer coverage; each harness fuzzes FUZZ_SECONDS (fails on any crash, leak or
# sanitizer report). bench/fuzz_long.sh runs them longer.
test-fuzz:
	CC=clang cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Debug -DANNEAL_FUZZ=ON \
	  -DANNEAL_FUZZ_SECONDS=$(FUZZ_SECONDS) $(CMAKE_FLAGS)
	cmake --build $(FUZZ_BUILD) --target fuzz -j $(JOBS)
	ctest --test-dir $(FUZZ_BUILD) -L fuzz --output-on-failure -j $(JOBS)

# Regenerates the PyTorch fixtures (needs Debian's python3-torch; not run in CI).
fixtures:
	/usr/bin/python3 tests/fixtures/gen_gpt2_tiny.py

bench: build
	bash bench/run.sh

# anneal fp32/bf16 against PyTorch fp32/bf16 autocast, GPT-2 124M and d6 at B=8 T=256,
# alternating, with MFU against a measured peak and the issue-5 goals (bench/bench_train.py;
# ~20-30 min on 2 cores). BENCH_ARGS=--quick for a smoke run; BENCH_TORCH2=0 skips PyTorch 2.x.
bench-train: build bench-torch
	python3 bench/bench_train.py --anneal $(BUILD)/anneal $(BENCH_ARGS)

# PyTorch for bench-train, best effort (the benchmark runs with whatever is there):
# Debian's python3-torch (and OpenBLAS for it) via apt-get when absent, and PyPI torch 2.x
# in $(BUILD)/bench-venv (about 5.5 GB: PyPI's Linux wheel pulls in the CUDA libraries), with
# transformers for bench/quant_speed.py's quantize_dynamic on torch 2.x.
BENCH_TORCH2 ?= 1
bench-torch:
	@/usr/bin/python3 -c "import torch" 2>/dev/null || apt-get install -y python3-torch \
	  || (apt-get update && apt-get install -y python3-torch) \
	  || echo "bench-torch: no Debian python3-torch; bench-train runs without it"
	@# Debian's torch does fp32 GEMMs through libblas.so.3: the reference BLAS unless OpenBLAS is there
	@/usr/bin/python3 -c "import torch; torch.ones(8, 8) @ torch.ones(8, 8); \
	  exit(0 if 'openblas' in open('/proc/self/maps').read() else 1)" 2>/dev/null \
	  || ! /usr/bin/python3 -c "import torch" 2>/dev/null || apt-get install -y libopenblas0-pthread \
	  || echo "bench-torch: no OpenBLAS; Debian's PyTorch fp32 runs on the reference BLAS (slow)"
	@if [ "$(BENCH_TORCH2)" != 0 ] && [ ! -x $(BUILD)/bench-venv/bin/python ]; then \
	  { python3 -m venv $(BUILD)/bench-venv && $(BUILD)/bench-venv/bin/pip install -q torch numpy transformers==4.39.3; } \
	  || { echo "bench-torch: PyPI torch 2.x not installed; bench-train runs without it"; rm -rf $(BUILD)/bench-venv; }; \
	fi

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD) .venv

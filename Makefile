# anneal: top-level entry points. `make demo` and `make test` set everything up
# (Debian packages via scripts/bootstrap.sh) and run; the rest are for developers.
BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all build demo test test-asan test-fast bootstrap fixtures bench clean

all: build

bootstrap:
	@bash scripts/bootstrap.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# A short GPT-2 training run on synthetic tokens: prints the falling loss.
demo: bootstrap build
	./$(BUILD)/anneal train --model tiny --synthetic --steps 150 --batch 16 --seq 64 --lr 1e-2 --warmup 10 --log-every 10

# The test suite (Release build), then the same suite under ASan + UBSan.
test: bootstrap build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)
	$(MAKE) test-asan

test-fast: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

test-asan:
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DANNEAL_SANITIZE=ON $(CMAKE_FLAGS)
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --test-dir $(ASAN_BUILD) --output-on-failure -j $(JOBS)

# Regenerates the PyTorch fixtures (needs Debian's python3-torch; not run in CI).
fixtures:
	/usr/bin/python3 tests/fixtures/gen_gpt2_tiny.py

bench: build
	bash bench/run.sh

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)

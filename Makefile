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

# Trains a small GPT-2 on the King James Bible for a few minutes (val loss falling),
# then generates a passage (scripts/demo.sh; choices explained in README.md).
demo: bootstrap build
	BUILD=$(BUILD) bash scripts/demo.sh

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

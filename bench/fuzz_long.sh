#!/usr/bin/env bash
# Longer offline fuzzing (issue 16; not in CI): every libFuzzer harness of tests/fuzz for
# MINUTES each (default 10), one after another (JOBS at once, default 1), in the clang
# build FUZZ_BUILD (default build-fuzz, made here when missing: CC=clang, ANNEAL_FUZZ=ON).
# The corpus grows in FUZZ_BUILD/fuzz-corpus/NAME (kept between runs; the committed seeds
# are read, never written); crashes go to FUZZ_BUILD/fuzz-artifacts/NAME/. Prints per
# harness: execs, execs/s, corpus size, crashes found by this run; exits 1 if any
# harness crashed.
#   bench/fuzz_long.sh [MINUTES] [NAME...]
set -uo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-10}
shift || true
build=${FUZZ_BUILD:-build-fuzz}
jobs=${JOBS:-1}
if [ ! -f "$build/CMakeCache.txt" ]; then
  CC=clang cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DANNEAL_FUZZ=ON >/dev/null || exit 1
fi
cmake --build "$build" --target fuzz -j "$(nproc)" >/dev/null || exit 1
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in tests/fuzz/fuzz_*.c; do n=$(basename "$f" .c); names+=("${n#fuzz_}"); done
fi
export ANNEAL_SOURCE_DIR=$PWD
secs=${FUZZ_SECONDS_EACH:-$((minutes * 60))}
if [ "$secs" -le 0 ]; then echo "fuzz_long.sh: MINUTES must be >= 1 (libFuzzer reads 0 as no limit)" >&2; exit 2; fi
fail=0
printf "%-16s %12s %10s %8s %8s\n" harness execs execs/s corpus crashes
for name in "${names[@]}"; do
  corpus=$build/fuzz-corpus/$name art=$build/fuzz-artifacts/$name
  mkdir -p "$corpus" "$art"
  seeds=(tests/fuzz/corpus/"$name")
  [ -d tests/fuzz/regressions/"$name" ] && seeds+=(tests/fuzz/regressions/"$name")
  log=$build/fuzz-$name.log
  stamp=$build/fuzz-$name.stamp
  touch "$stamp"
  par=()
  [ "$jobs" -gt 1 ] && par=(-jobs="$jobs" -workers="$jobs") # libFuzzer's own fuzz-N.log per job then
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$build/fuzz_$name" "$corpus" "${seeds[@]}" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="$art/" "${par[@]}" >"$log" 2>&1
  rc=$?
  execs=$(grep -h "stat::number_of_executed_units" "$log" 2>/dev/null | head -1 | awk '{print $2}')
  [ -z "$execs" ] && execs=$(grep -o "^#[0-9]*" "$log" | tail -1 | tr -d '#')
  # what this run found (older artifacts stay in $art until removed)
  crashes=$(find "$art" -type f -newer "$stamp" 2>/dev/null | grep -c -E "/(crash|leak|timeout|oom|slow-unit)-" || true)
  [ $rc -ne 0 ] && fail=1
  printf "%-16s %12s %10s %8s %8s\n" "$name" "${execs:-?}" "$(( ${execs:-0} / (secs > 0 ? secs : 1) ))" \
    "$(ls "$corpus" | wc -l)" "$crashes"
done
exit $fail

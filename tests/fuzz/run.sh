#!/usr/bin/env bash
# Runs one libFuzzer harness for a bounded time (ctest fuzz/run_<name>, ANNEAL_FUZZ
# builds): BIN NAME SECONDS. New inputs go to a scratch corpus (the committed seed corpus
# tests/fuzz/corpus/NAME is only read); a crash, leak, timeout, out-of-memory or
# sanitizer report fails the test and leaves the input in build's fuzz-artifacts/NAME/
# with how to keep it as a regression (tests/fuzz/regressions/NAME/). Prints the execs.
set -uo pipefail
bin=$1 name=$2 secs=${3:-15}
src=${ANNEAL_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
art=$(dirname "$bin")/fuzz-artifacts/$name
mkdir -p "$art"
work=$(mktemp -d /tmp/anneal_fuzz_corpus_XXXXXX)
trap 'rm -rf "$work"' EXIT
seeds=("$src/tests/fuzz/corpus/$name")
[ -d "$src/tests/fuzz/regressions/$name" ] && seeds+=("$src/tests/fuzz/regressions/$name")
dict=()
[ -f "$src/tests/fuzz/$name.dict" ] && dict=(-dict="$src/tests/fuzz/$name.dict")
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
  "$bin" "$work" "${seeds[@]}" "${dict[@]}" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
  -max_len=65536 -print_final_stats=1 -artifact_prefix="$art/" >"$work.log" 2>&1
rc=$?
grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ +DONE)" "$work.log"
if [ $rc -ne 0 ]; then
  tail -60 "$work.log"
  echo "fuzz/$name: FAILED (exit $rc); the input is in $art/: copy it to tests/fuzz/regressions/$name/ with the fix"
fi
rm -f "$work.log"
exit $rc

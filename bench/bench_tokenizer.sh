#!/usr/bin/env bash
# GPT-2 encode throughput, one thread, anneal vs tiktoken (PyPI) in the same run, both
# built from the same encoder.json + vocab.bpe (data/gpt2), on the KJV text (Debian's
# bible-kjv: `bible gen1:1-rev22:21`, 4.3 MB; falls back to ../shared's kjv_head.txt).
# Runs the two alternately ROUNDS times so machine noise hits both, checks that the ids
# are identical, and prints MB/s and the ratio. tiktoken is installed into a venv
# (build/bench-venv, or $ANNEAL_BENCH_VENV) on first use.
#   bash bench/bench_tokenizer.sh [rounds]
# anneal's figure is the first encode of each process (a cold piece cache), best over the
# rounds; tiktoken's is its best encode (it keeps no cache between calls).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
BIN=${ANNEAL_BIN:-build/anneal}
[ -x "$BIN" ] || { echo "bench_tokenizer: build anneal first (cmake -S . -B build && cmake --build build), or set ANNEAL_BIN" >&2; exit 2; }
GPT2=data/gpt2
VENV=${ANNEAL_BENCH_VENV:-build/bench-venv}
PY=${PYTHON:-python3}
if ! "$VENV/bin/python" -c "import tiktoken" 2>/dev/null; then
  echo "bench_tokenizer: installing tiktoken into $VENV" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet tiktoken
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
TEXT=$WORK/kjv.txt
if command -v bible >/dev/null 2>&1 && bible gen1:1-rev22:21 > "$TEXT" 2>/dev/null && [ -s "$TEXT" ]; then
  SRC="KJV (bible gen1:1-rev22:21)"
elif [ -f ../shared/data/tokenizer/kjv_head.txt ]; then
  cp ../shared/data/tokenizer/kjv_head.txt "$TEXT"; SRC="kjv_head.txt (bible-kjv not installed)"
else
  echo "bench_tokenizer: no text: install bible-kjv" >&2; exit 2
fi
BYTES=$(wc -c < "$TEXT")
echo "text: $SRC, $BYTES bytes; $ROUNDS rounds; tokenizer files: $GPT2"
best_a=0; best_t=0
for r in $(seq "$ROUNDS"); do
  "$BIN" tokenize --tokenizer "$GPT2" --bench < "$TEXT" > "$WORK/anneal.ids" 2> "$WORK/anneal.log"
  cat "$WORK/anneal.log"
  a=$(sed -n 's/.*first encode [0-9.]* s (\([0-9.]*\) MB\/s).*/\1/p' "$WORK/anneal.log")
  "$VENV/bin/python" bench/tiktoken_encode.py --encoder "$GPT2/encoder.json" --vocab "$GPT2/vocab.bpe" \
      --text "$TEXT" --out "$WORK/tiktoken.ids" --repeat 3 > "$WORK/tiktoken.log"
  grep -v '^TIKTOKEN_MBPS' "$WORK/tiktoken.log"
  t=$(sed -n 's/^TIKTOKEN_MBPS //p' "$WORK/tiktoken.log")
  best_a=$(awk -v x="$a" -v y="$best_a" 'BEGIN{print (x>y)?x:y}')
  best_t=$(awk -v x="$t" -v y="$best_t" 'BEGIN{print (x>y)?x:y}')
done
if cmp -s "$WORK/anneal.ids" "$WORK/tiktoken.ids"; then same="identical"; else same="DIFFERENT"; fi
n_ids=$(wc -w < "$WORK/anneal.ids")
echo "ids: $n_ids, anneal and tiktoken $same"
awk -v a="$best_a" -v t="$best_t" 'BEGIN{printf "one thread: anneal %.1f MB/s (cold cache), tiktoken %.1f MB/s: %.2fx\n", a, t, a/t}'
# anneal prepare: wall time for the whole corpus (tokenizer load + encode + shard write).
for th in 1 2; do
  s=$(date +%s.%N)
  "$BIN" prepare --tokenizer "$GPT2" --input "$TEXT" --threads "$th" --out "$WORK/shards_$th" > /dev/null
  e=$(date +%s.%N)
  awk -v s="$s" -v e="$e" -v b="$BYTES" -v th="$th" 'BEGIN{printf "anneal prepare, %d thread(s): %.3f s wall (%.1f MB/s)\n", th, e-s, b/(e-s)/1e6}'
done
cmp -s "$WORK/shards_1/train_000000.bin" "$WORK/shards_2/train_000000.bin" && echo "prepare: shards identical for 1 and 2 threads"
[ "$same" = identical ]

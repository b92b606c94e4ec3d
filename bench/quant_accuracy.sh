#!/usr/bin/env bash
# int8 accuracy: trains a small GPT-2 (preset d6) on the King James Bible (Debian's
# bible-kjv: `bible gen1:1-rev22:21`; falls back to ../shared's kjv_head.txt), quantizes it
# with `anneal quantize` in every mode, and prints the held-out perplexity (the val split
# that `anneal prepare` keeps out of training) of each against the bf16 model.
# An accuracy figure, not a timing: the numbers do not depend on the machine's load.
#   bash bench/quant_accuracy.sh            (STEPS=300 BATCH=8 SEQ=64 THREADS=2 by default;
#                                             QUICK=1: only bf16, fp32, weight-only and dynamic
#                                             with int8 and f32 heads, static min/max)
# Goal (issue 13): weight-only and dynamic <= 1% worse perplexity than bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${ANNEAL_BIN:-build/anneal}
STEPS=${STEPS:-300}
BATCH=${BATCH:-8}
SEQ=${SEQ:-64}
THREADS=${THREADS:-2}
[ -x "$BIN" ] || { echo "quant_accuracy: build anneal first (cmake -S . -B build && cmake --build build)" >&2; exit 2; }
WORK=${WORK:-$(mktemp -d)}
[ -n "${KEEP:-}" ] || trap 'rm -rf "$WORK"' EXIT
TEXT=$WORK/kjv.txt
if command -v bible >/dev/null 2>&1 && bible gen1:1-rev22:21 > "$TEXT" 2>/dev/null && [ -s "$TEXT" ]; then
  SRC="KJV (bible gen1:1-rev22:21)"
elif [ -f ../shared/data/tokenizer/kjv_head.txt ]; then
  cp ../shared/data/tokenizer/kjv_head.txt "$TEXT"; SRC="kjv_head.txt (bible-kjv not installed)"
else
  echo "quant_accuracy: no text: install bible-kjv" >&2; exit 2
fi
echo "text: $SRC, $(wc -c < "$TEXT") bytes; d6, $STEPS steps of $BATCH x $SEQ, $THREADS threads"
"$BIN" prepare --tokenizer gpt2 --input "$TEXT" --out "$WORK/data" --val-fraction 0.02 --threads "$THREADS" > /dev/null
"$BIN" train --model d6 --data "$WORK/data" --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" --lr 1e-3 --warmup 20 \
    --dtype bf16 --threads "$THREADS" --eval-batches 0 --ckpt-every 0 --out "$WORK/run" > "$WORK/train.log" 2>&1 \
  || { tail -20 "$WORK/train.log" >&2; exit 1; }
tail -2 "$WORK/train.log"
ev() { # model-flag model dtype -> "loss ppl"
  "$BIN" eval --"$1" "$2" --data "$WORK/data" --split val --batch "$BATCH" --seq "$SEQ" --dtype "$3" \
      --threads "$THREADS" --json 2>/dev/null | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["loss"], j["ppl"], j["tokens"])'
}
read -r L_BF16 P_BF16 TOK <<< "$(ev ckpt "$WORK/run" bf16)"
read -r L_F32 P_F32 _ <<< "$(ev ckpt "$WORK/run" fp32)"
printf "%-34s %10s %10s %9s\n" "model (held-out: $TOK tokens)" "loss" "ppl" "vs bf16"
printf "%-34s %10.5f %10.4f %9s\n" "bf16" "$L_BF16" "$P_BF16" "-"
printf "%-34s %10.5f %10.4f %+8.3f%%\n" "fp32" "$L_F32" "$P_F32" "$(python3 -c "print(100*($P_F32/$P_BF16-1))")"
row() { # name quantize-flags eval-dtype
  local q="$WORK/q_$1"
  # shellcheck disable=SC2086
  "$BIN" quantize --ckpt "$WORK/run" --out "$q" $2 --threads "$THREADS" 2> "$WORK/q_$1.log" \
    || { cat "$WORK/q_$1.log" >&2; exit 1; }
  read -r L P _ <<< "$(ev ckpt "$q" "$3")"
  printf "%-34s %10.5f %10.4f %+8.3f%%\n" "$1 (eval $3)" "$L" "$P" "$(python3 -c "print(100*($P/$P_BF16-1))")"
}
# the lm head is int8 unless --head f32 (anneal quantize's default since the int8 head)
row weight-only "--mode weight-only" fp32
row weight-only-f32-head "--mode weight-only --head f32" fp32
[ -n "${QUICK:-}" ] || {
row weight-only-bf16 "--mode weight-only" bf16
row weight-only-g32 "--mode weight-only --group 32" fp32
row weight-only-g128 "--mode weight-only --group 128" fp32
}
row dynamic "--mode dynamic" fp32
row dynamic-f32-head "--mode dynamic --head f32" fp32
row static-minmax "--mode static --calib-data $WORK/data --calib-batches 16 --batch $BATCH --seq $SEQ" fp32
[ -n "${QUICK:-}" ] || row static-p99.99 "--mode static --calib-data $WORK/data --calib-batches 16 --batch $BATCH --seq $SEQ --calib-method percentile --percentile 99.99" fp32

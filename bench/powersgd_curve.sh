#!/usr/bin/env bash
# PowerSGD vs plain all-reduce on real text: two data-parallel runs of the d6 GPT-2
# (6 layers, 384 wide) on the KJV Bible, `mpirun -np 2`, identical but for
# --grad-compress, then both loss curves side by side (every 10th step and the
# evaluations) and the bytes each rank handed to all-reduce (PowerSGD's P, Q and
# uncompressed vectors vs the full gradients). A loss curve, not a timing: the step
# times of a shared machine are not reported.
#   bash bench/powersgd_curve.sh [BIN] [OUTDIR]
# Environment: STEPS (300), RANK (PowerSGD rank, 4), WARMUP (PowerSGD warm-up steps,
# 10), BATCH (global batch, 16), SEQ (64), THREADS (per rank, 1), DATA_DIR (a prepared
# KJV directory; made with BIN when missing: vocabulary 1024).
set -euo pipefail

BIN=${1:-build/anneal}
OUT=${2:-/tmp/anneal-powersgd-curve}
STEPS=${STEPS:-300}
RANK=${RANK:-4}
WARMUP=${WARMUP:-10}
BATCH=${BATCH:-16}
SEQ=${SEQ:-64}
THREADS=${THREADS:-1}
DATA_DIR=${DATA_DIR:-/tmp/anneal-trajectory-data}
mkdir -p "$OUT" "$DATA_DIR"

if [ ! -s "$DATA_DIR/data/prepare.json" ]; then
  bible gen1:1-rev22:21 > "$DATA_DIR/kjv.txt"
  "$BIN" tokenizer train --vocab-size 1024 --input "$DATA_DIR/kjv.txt" --out "$DATA_DIR/tokenizer" >/dev/null
  "$BIN" prepare --tokenizer "$DATA_DIR/tokenizer" --input "$DATA_DIR/kjv.txt" --out "$DATA_DIR/data" \
    --val-fraction 0.01 >/dev/null
fi

MPI="mpirun -np 2 --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS=$THREADS --mca btl_vader_single_copy_mechanism none"
run() {
  local name=$1; shift
  rm -rf "$OUT/run_$name"
  $MPI "$BIN" train --model d6 --data "$DATA_DIR/data" --out "$OUT/run_$name" \
    --batch "$BATCH" --seq "$SEQ" --steps "$STEPS" --lr 1e-3 --warmup 20 --schedule cosine --clip 1.0 \
    --dropout 0 --eval-every 100 --eval-batches 8 --ckpt-every 0 --threads "$THREADS" --seed 7 \
    --log-every 50 "$@" > "$OUT/$name.out" 2>&1
}

run plain --grad-compress none
run powersgd --grad-compress powersgd --powersgd-rank "$RANK" --powersgd-warmup-steps "$WARMUP"

python3 - "$OUT" "$RANK" <<'PY'
import json, sys
out, rank = sys.argv[1], sys.argv[2]
def load(name):
    steps, evals, summ = {}, {}, {}
    for line in open("%s/run_%s/log.jsonl" % (out, name)):
        r = json.loads(line)
        if r.get("type") == "step": steps[r["step"]] = r
        elif r.get("type") == "eval": evals[r["step"]] = r["val_loss"]
        elif r.get("type") == "summary": summ = r
    return steps, evals, summ
a, ea, sa = load("plain")
b, eb, sb = load("powersgd")
print("step   loss (all-reduce)   loss (PowerSGD rank %s)   difference" % rank)
last = max(a)
for s in sorted(a):
    if s == 1 or s % 10 == 0 or s == last:
        print("%4d   %17.4f   %23.4f   %+10.4f" % (s, a[s]["loss"], b[s]["loss"], b[s]["loss"] - a[s]["loss"]))
for s in sorted(ea):
    print("eval at step %d: val loss %.4f (all-reduce), %.4f (PowerSGD)" % (s, ea[s], eb.get(s, float("nan"))))
def mean_last(d, k=20):
    xs = [d[s]["loss"] for s in sorted(d)[-k:]]
    return sum(xs) / len(xs)
print("mean train loss of the last 20 steps: %.4f (all-reduce), %.4f (PowerSGD)" % (mean_last(a), mean_last(b)))
cb, cu = sb.get("comm_bytes", 0), sb.get("comm_bytes_uncompressed", 0)
step = b[last]
print("bytes handed to all-reduce per rank, whole run: %.1f MB PowerSGD vs %.1f MB uncompressed (%.1fx less)"
      % (cb / 1e6, cu / 1e6, cu / cb if cb else float("nan")))
print("per compressed step: %d bytes vs %d (%.1fx less)" % (step["comm_bytes"], step["comm_bytes_uncompressed"],
      step["comm_bytes_uncompressed"] / step["comm_bytes"]))
PY

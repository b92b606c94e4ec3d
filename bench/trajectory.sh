#!/usr/bin/env bash
# Loss trajectories of one anneal binary, for before/after comparisons of a change
# that must not move a bit (a refactor): the per-step training losses, validation
# losses, an eval and a generated passage of a few short runs on the KJV corpus
# (fp32, bf16, fp16 with its loss scaler, recompute block, accumulation, dropout, and
# a resume), written as one text file per run. Compare two binaries with
#   bash bench/trajectory.sh OLD_BIN /tmp/old && bash bench/trajectory.sh NEW_BIN /tmp/new
#   diff -r /tmp/old /tmp/new      # empty when every loss is bit-identical
# Environment: DATA_DIR (a prepared KJV directory: tokenizer/ and data/; made with
# BIN when missing), STEPS (default 40), THREADS (default 2).
set -euo pipefail

BIN=${1:?usage: trajectory.sh BIN OUTDIR}
OUT=${2:?usage: trajectory.sh BIN OUTDIR}
STEPS=${STEPS:-40}
THREADS=${THREADS:-2}
DATA_DIR=${DATA_DIR:-/tmp/anneal-trajectory-data}
mkdir -p "$OUT" "$DATA_DIR"

if [ ! -s "$DATA_DIR/data/prepare.json" ]; then
  bible gen1:1-rev22:21 > "$DATA_DIR/kjv.txt"
  "$BIN" tokenizer train --vocab-size 1024 --input "$DATA_DIR/kjv.txt" --out "$DATA_DIR/tokenizer" >/dev/null
  "$BIN" prepare --tokenizer "$DATA_DIR/tokenizer" --input "$DATA_DIR/kjv.txt" --out "$DATA_DIR/data" \
    --val-fraction 0.01 >/dev/null
fi

cat > "$DATA_DIR/model.json" <<EOF
{"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 128,
 "vocab_size": 1024, "n_positions": 128, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}
EOF

# The step losses, eval losses and norms of a run's log, one line each.
extract() {
  python3 - "$1" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("type") == "step":
        print("step", r["step"], repr(r["loss"]), repr(r.get("grad_norm", r.get("norm"))))
    elif r.get("type") == "eval":
        print("eval", r["step"], repr(r["val_loss"]))
EOF
}

run() {
  local name=$1; shift
  rm -rf "$OUT/run_$name"
  "$BIN" train --config "$DATA_DIR/model.json" --data "$DATA_DIR/data" --out "$OUT/run_$name" \
    --batch 8 --seq 64 --steps "$STEPS" --lr 3e-3 --warmup 5 --schedule cosine --clip 1.0 \
    --eval-every 20 --eval-batches 4 --ckpt-every 20 --threads "$THREADS" --seed 7 "$@" >/dev/null
  extract "$OUT/run_$name/log.jsonl" > "$OUT/$name.txt"
}

run fp32
run bf16 --dtype bf16
run fp16 --dtype fp16
run recompute_block --recompute block
run recompute_attn --recompute attn --dtype bf16
run accum --accum 2
run dropout --dropout 0.1
# an interrupted run resumed: the same losses as the run above from its checkpoint on
rm -rf "$OUT/run_resume"
"$BIN" train --config "$DATA_DIR/model.json" --data "$DATA_DIR/data" --out "$OUT/run_resume" \
  --batch 8 --seq 64 --steps "$STEPS" --lr 3e-3 --warmup 5 --schedule cosine --clip 1.0 \
  --eval-every 20 --eval-batches 4 --ckpt-every 20 --threads "$THREADS" --seed 7 --stop-at 20 >/dev/null
"$BIN" train --resume "$OUT/run_resume" --threads "$THREADS" >/dev/null
extract "$OUT/run_resume/log.jsonl" > "$OUT/resume.txt"

"$BIN" eval --ckpt "$OUT/run_fp32" --data "$DATA_DIR/data" --threads "$THREADS" 2>/dev/null > "$OUT/eval.txt"
"$BIN" generate --ckpt "$OUT/run_fp32" --tokenizer "$DATA_DIR/tokenizer" --prompt "And God said" \
  --max-tokens 40 --temperature 0.8 --top-k 40 --seed 3 --threads "$THREADS" 2>/dev/null > "$OUT/generate.txt"
for d in "$OUT"/run_*; do rm -rf "$d"; done
echo "trajectory: $(ls "$OUT" | wc -l) files in $OUT"

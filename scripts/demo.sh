#!/usr/bin/env bash
# make demo: trains a small GPT-2 on the King James Bible for a few minutes on the CPU
# and ends with a generated passage. Steps (each cached in $DEMO_DIR except training):
#   1. the text:      bible gen1:1-rev22:21 (Debian's bible-kjv, 4.3 MB)
#   2. a tokenizer:   byte-level BPE with $VOCAB ids learned from it (anneal tokenizer train)
#   3. token shards:  train + 1% val (anneal prepare)
#   4. training:      $STEPS steps of a ${LAYERS}-layer, ${EMBD}-channel GPT-2, val loss every $EVAL steps
#   5. a passage:     anneal generate from the final checkpoint
# The choices (tokenizer, size, steps) and the measurements behind them are in README.md.
# Environment: BUILD (default build), DEMO_DIR (default $BUILD/demo), DEMO_STEPS,
# DEMO_THREADS (default: all cores).
set -euo pipefail

BUILD=${BUILD:-build}
BIN=${BIN:-$BUILD/anneal}
DIR=${DEMO_DIR:-$BUILD/demo}
VOCAB=4096
LAYERS=4
HEADS=4
EMBD=256
CTX=128
BATCH=16
STEPS=${DEMO_STEPS:-600}
EVAL=$(( STEPS / 10 > 0 ? STEPS / 10 : 1 ))
THREADS=${DEMO_THREADS:-0}
PROMPT="And God said"

if [ ! -x "$BIN" ]; then
  echo "demo: $BIN not found (run make build first)" >&2
  exit 1
fi
if ! command -v bible >/dev/null 2>&1; then
  echo "demo: the bible program is missing: install Debian's bible-kjv (scripts/bootstrap.sh does)" >&2
  exit 1
fi
mkdir -p "$DIR"
start=$(date +%s)

# 1. the corpus (written to a temporary name first: a partial file is never reused)
if [ ! -s "$DIR/kjv.txt" ]; then
  echo "== 1/5 the King James Bible (bible gen1:1-rev22:21)"
  bible gen1:1-rev22:21 > "$DIR/kjv.txt.tmp"
  mv "$DIR/kjv.txt.tmp" "$DIR/kjv.txt"
fi
echo "corpus: $DIR/kjv.txt, $(wc -c < "$DIR/kjv.txt") bytes"

# 2. the tokenizer
if [ ! -s "$DIR/tokenizer/tokenizer.json" ]; then
  echo "== 2/5 learning a $VOCAB-id BPE tokenizer from it"
  "$BIN" tokenizer train --vocab-size "$VOCAB" --input "$DIR/kjv.txt" --out "$DIR/tokenizer"
fi

# 3. token shards
if [ ! -s "$DIR/data/prepare.json" ]; then
  echo "== 3/5 tokenizing into train/val shards"
  "$BIN" prepare --tokenizer "$DIR/tokenizer" --input "$DIR/kjv.txt" --out "$DIR/data" --val-fraction 0.01
fi

# 4. training (a fresh run each time; Ctrl-C stops it with a checkpoint, and
#    `build/anneal train --resume build/demo/run` would continue it)
cat > "$DIR/model.json" <<EOF
{"model_type": "gpt2", "n_layer": $LAYERS, "n_head": $HEADS, "n_embd": $EMBD,
 "vocab_size": $VOCAB, "n_positions": $CTX, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}
EOF
rm -rf "$DIR/run"
echo "== 4/5 training ($STEPS steps; val loss every $EVAL)"
"$BIN" train --config "$DIR/model.json" --data "$DIR/data" --out "$DIR/run" \
  --batch "$BATCH" --seq "$CTX" --steps "$STEPS" --lr 3e-3 --min-lr 3e-4 --warmup 30 --schedule cosine \
  --weight-decay 0.1 --clip 1.0 --eval-every "$EVAL" --eval-batches 8 --ckpt-every 200 --keep 2 \
  --sample-every "$(( STEPS / 2 ))" --sample-tokens 48 --sample-prompt "$PROMPT" --threads "$THREADS" --tensorboard

# 5. a passage from the trained model
echo "== 5/5 a passage from the trained model (prompt: \"$PROMPT\")"
"$BIN" generate --ckpt "$DIR/run" --tokenizer "$DIR/tokenizer" --prompt "$PROMPT" --max-tokens 160 \
  --temperature 0.7 --top-k 40 --seed 7 --threads "$THREADS"
echo
"$BIN" report "$DIR/run"
"$BIN" plot "$DIR/run" --out "$DIR/run/plot.png" >/dev/null
echo "demo: done in $(( $(date +%s) - start )) s (run directory $DIR/run: log.jsonl, checkpoints, tensorboard/)"
echo "demo: training curves in $DIR/run/plot.png (anneal plot; TensorBoard: tensorboard --logdir $DIR/run/tensorboard)"

#!/usr/bin/env bash
# Issue 13's speed figures in one command, each comparison side by side in one run, into
# OUT (default bench/results/$(date +%F)-deploy):
#   decode_int8.log   anneal int8 dynamic (int8 head, bf16 KV) vs llama.cpp Q8_0, batch 1
#   decode_bf16.log   anneal bf16 (bf16 KV) vs llama.cpp F16, batch 1
#   serve_int8.log    anneal serve, the int8 model: 16 streams vs 1 stream (+ the load test)
#   serve_bf16.log    anneal serve --dtype bf16 (the f32 model's bf16 copies): 16 streams vs 1
#   with FULL=1 also:
#   load_test.log     the issue's load test at its size: 64 streams for 60 s, 1,000 malformed requests
#   quant_speed.log   anneal int8 vs PyTorch quantize_dynamic (TORCH_PY: a Python with torch and
#                     transformers, default .venv/bin/python, which has transformers and sees
#                     Debian's python3-torch from make bench-torch; the OpenBLAS variables unset for it)
#   quant_speed_torch2.log  the same against PyPI's torch 2.x (TORCH2_PY, default build/bench-venv's
#                     python from make bench-torch), where it has transformers
#   lscpu.txt, commit.txt, load.txt (uptime before and after each part)
# GPT-2 124M with random weights (the preset), prompt 512, 128 decode steps, THREADS
# threads (default 2). Needs build/anneal and .venv (make bootstrap: llama-cpp-python).
# Run it on a quiet machine: the figures are only as good as the machine is idle.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/$(date +%F)-deploy}
THREADS=${THREADS:-2}
BIN=${BIN:-build/anneal}
PY=.venv/bin/python
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
git rev-parse HEAD > "$OUT/commit.txt"
: > "$OUT/load.txt"
load() { echo "$1: $(uptime)" >> "$OUT/load.txt"; }

load "decode int8"
$PY bench/decode.py --bin "$BIN" --model 124M --tokenizer gpt2 --quant dynamic --kv-dtype bf16 --threads "$THREADS" \
    --no-transformers 2>&1 | tee "$OUT/decode_int8.log"
load "decode bf16"
$PY bench/decode.py --bin "$BIN" --model 124M --tokenizer gpt2 --dtype bf16 --kv-dtype bf16 --threads "$THREADS" \
    --no-transformers 2>&1 | tee "$OUT/decode_bf16.log"

load "serve int8"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$BIN" export --model 124M --format hf --out "$tmp/hf" --tokenizer gpt2 > /dev/null
"$BIN" quantize --model "$tmp/hf" --out "$tmp/q" --mode dynamic > /dev/null
$PY bench/serve_load.py --bin "$BIN" --model "$tmp/q" --tokenizer gpt2 --seconds 20 --compare-seconds 15 \
    --malformed 300 --engine-baseline -- --kv-dtype bf16 --threads "$THREADS" 2>&1 | tee "$OUT/serve_int8.log"
load "serve bf16"
$PY bench/serve_load.py --bin "$BIN" --model "$tmp/hf" --tokenizer gpt2 --seconds 10 --compare-seconds 15 \
    --malformed 100 --engine-baseline -- --dtype bf16 --kv-dtype bf16 --threads "$THREADS" 2>&1 | tee "$OUT/serve_bf16.log"
if [ "${FULL:-0}" = 1 ]; then
    load "load test"
    $PY bench/serve_load.py --bin "$BIN" --model "$tmp/q" --tokenizer gpt2 --streams 64 --seconds 60 --malformed 1000 \
        --compare-seconds 15 -- --kv-dtype bf16 --threads "$THREADS" 2>&1 | tee "$OUT/load_test.log"
    load "quant speed"
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "${TORCH_PY:-$PY}" bench/quant_speed.py --bin "$BIN" --model 124M \
        --threads "$THREADS" 2>&1 | tee "$OUT/quant_speed.log"
    T2=${TORCH2_PY:-build/bench-venv/bin/python}
    if "$T2" -c "import torch, transformers" 2> /dev/null; then
        load "quant speed torch 2"
        env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$T2" bench/quant_speed.py --bin "$BIN" --model 124M \
            --threads "$THREADS" 2>&1 | tee "$OUT/quant_speed_torch2.log"
    else
        echo "deploy_speed: no torch 2.x with transformers at $T2 (make bench-torch): quant_speed_torch2.log skipped" \
            | tee "$OUT/quant_speed_torch2.log"
    fi
fi
load "end"
echo "deploy_speed: logs in $OUT"

#!/usr/bin/env bash
# Side-by-side training-step benchmark: anneal vs PyTorch fp32 eager (Debian's
# python3-torch), same GPT-2 shape, same threads, run alternately ROUNDS times so
# machine noise hits both. OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE (set by this workplace;
# they halve OpenBLAS speed) are unset for the PyTorch runs only.
#   bash bench/run.sh [preset] [batch] [seq] [steps] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${1:-124M}; B=${2:-4}; T=${3:-64}; STEPS=${4:-6}; ROUNDS=${5:-2}; THREADS=${THREADS:-2}
case "$PRESET" in
  tiny) L=2; H=4; C=64; V=512; CTX=256;;
  d6) L=6; H=6; C=384; V=50257; CTX=1024;;
  124M) L=12; H=12; C=768; V=50257; CTX=1024;;
  *) echo "bench: preset $PRESET not wired here" >&2; exit 2;;
esac
BIN=${ANNEAL_BIN:-build/anneal}
[ -x "$BIN" ] || { echo "bench: build first (make build)" >&2; exit 2; }
echo "GPT-2 $PRESET, B=$B T=$T, $THREADS threads, $STEPS steps x $ROUNDS rounds (first step of each run excluded)"
for r in $(seq "$ROUNDS"); do
  /usr/bin/time -f "anneal peak RSS %M KiB" "$BIN" train --model "$PRESET" --synthetic --batch "$B" --seq "$T" \
      --steps "$STEPS" --threads "$THREADS" --log-every 1000 2>&1 | grep -E "^done|peak RSS"
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 bench/torch_gpt2.py --layers $L --heads $H \
      --embd $C --vocab $V --ctx $CTX --batch "$B" --seq "$T" --steps "$STEPS" --threads "$THREADS"
done

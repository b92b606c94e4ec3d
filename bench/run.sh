#!/usr/bin/env bash
# Side-by-side training-step benchmark: anneal vs PyTorch fp32 eager (Debian's
# python3-torch), same GPT-2 shape, same threads, run alternately ROUNDS times so
# machine noise hits both. Step times exclude each run's first step. OPENBLAS_CORETYPE /
# OPENBLAS_L2_SIZE (set by this workplace; they halve OpenBLAS speed) are unset for the
# PyTorch runs only.
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
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "GPT-2 $PRESET, B=$B T=$T, $THREADS threads, $STEPS steps x $ROUNDS rounds (first step of each run excluded)"
for r in $(seq "$ROUNDS"); do
  /usr/bin/time -f "%M" -o "$WORK/rss" "$BIN" train --synthetic --model "$PRESET" --batch "$B" --seq "$T" \
      --steps "$STEPS" --threads "$THREADS" --eval-batches 0 --out "$WORK/run$r" --log-every 1000 > /dev/null
  /usr/bin/python3 - "$WORK/run$r/log.jsonl" "$WORK/rss" "$B" "$T" <<'PY'
import json, statistics, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l and '"ms"' in l]
ms = [s["ms"] for s in steps][1:]
rss = int(open(sys.argv[2]).read().split()[-1]) / 1024
med = statistics.median(ms)
print(json.dumps({"impl": "anneal", "ms": [round(x, 1) for x in ms], "median_ms": round(med, 1),
                  "tokens_per_s": round(int(sys.argv[3]) * int(sys.argv[4]) / (med / 1e3), 1),
                  "peak_rss_mib": round(rss, 1)}))
PY
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 bench/torch_gpt2.py --layers $L --heads $H \
      --embd $C --vocab $V --ctx $CTX --batch "$B" --seq "$T" --steps "$STEPS" --threads "$THREADS"
done

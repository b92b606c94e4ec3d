#!/usr/bin/env bash
# Distributed training benchmark (mpirun, one machine): the same global batch trained
#   - by 1 process x 2 threads (the single-process baseline),
#   - by 2 ranks x 1 thread, gradient all-reduce overlapped with backward (default),
#   - by 2 ranks x 1 thread with --overlap off (all buckets reduced after backward),
#   - by 2 ranks x 1 thread at --zero 1 and --zero 2,
# on the d6 model (6 layers, 384 channels, GPT-2 vocabulary) with synthetic tokens.
# Prints tokens/s (median step time, first step excluded), the ratio to the baseline,
# and per-rank memory: the trainer's figures for parameters / gradients / optimizer
# state (its "memory" log record: the most a rank held in a step, after the gradient
# sync) and each process's peak RSS.
# ROUNDS (default 2) repeats the five runs alternately and keeps each run's fastest
# median, so load from other processes on the machine hits every configuration alike.
#   bash bench/bench_dist.sh [batch] [seq] [steps]     (global batch; defaults 8 256 5: the
#   issue-5 shape, where compute, not the all-reduce, dominates a step)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-8}; T=${2:-256}; STEPS=${3:-5}; ROUNDS=${ROUNDS:-2}
BIN=${ANNEAL_BIN:-build/anneal}
[ -x "$BIN" ] || { echo "bench_dist: build first (make build)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "bench_dist: mpirun not found (apt-get install openmpi-bin)" >&2; exit 2; }
BIN=$(realpath "$BIN")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
MPI=(mpirun -np 2 --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS=1)
COMMON=(train --synthetic --model d6 --batch "$B" --seq "$T" --steps "$STEPS" --eval-batches 0 --ckpt-every 0
        --dropout 0 --peak-gflops 100 --log-every 1000)
echo "d6 (L6 C384, vocab 50257), global batch $B x $T tokens, $STEPS steps (first excluded), $ROUNDS rounds, $(nproc) cores"

# name, launcher..., -- extra flags
run() {
  local name=$1; shift
  local launcher=() extra=()
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done; shift
  extra=("$@")
  # each process records its own peak RSS in $WORK/$name.rss.<rank>
  "${launcher[@]}" sh -c '/usr/bin/time -f %M -o "$0.${OMPI_COMM_WORLD_RANK:-0}" "$@"' "$WORK/$name.rss" \
      "$BIN" "${COMMON[@]}" "${extra[@]}" --out "$WORK/$name" > "$WORK/$name.out" 2>&1 \
      || { echo "bench_dist: $name failed:"; tail -20 "$WORK/$name.out"; exit 1; }
}

for r in $(seq "$ROUNDS"); do
  run "single.$r" -- --threads 2
  run "ddp.$r" "${MPI[@]}" -- --threads 1
  run "ddp_nooverlap.$r" "${MPI[@]}" -- --threads 1 --overlap off
  run "zero1.$r" "${MPI[@]}" -- --threads 1 --zero 1
  run "zero2.$r" "${MPI[@]}" -- --threads 1 --zero 2
done

/usr/bin/python3 - "$WORK" "$B" "$T" "$ROUNDS" <<'PY'
import glob, json, os, statistics, sys
work, B, T, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def load1(name):
    recs = [json.loads(l) for l in open(os.path.join(work, name, "log.jsonl"))]
    ms = [r["ms"] for r in recs if r.get("type") == "step"][1:]
    mem = [r for r in recs if r.get("type") == "memory" and r.get("when") == "peak in a step"]
    rss = [int(open(p).read().split()[-1]) / 1024 for p in sorted(glob.glob(os.path.join(work, name + ".rss.*")))]
    return statistics.median(ms), mem[0]["ranks"] if mem else None, rss
def load(name):
    return min((load1(f"{name}.{r}") for r in range(1, rounds + 1)), key=lambda x: x[0])
base = None
print(f"{'run':<34} {'ms/step':>8} {'tok/s':>8} {'vs 1x2':>7}   per-rank memory MiB (params/grads/optim | peak RSS)")
for name, label in [("single", "1 rank x 2 threads"), ("ddp", "2 ranks x 1 thread, overlap on"),
                    ("ddp_nooverlap", "2 ranks x 1 thread, overlap off"), ("zero1", "2 ranks x 1 thread, ZeRO-1"),
                    ("zero2", "2 ranks x 1 thread, ZeRO-2")]:
    ms, mem, rss = load(name)
    tps = B * T / (ms / 1e3)
    if base is None: base = tps
    if mem:
        m = "; ".join(f"r{i}: {r['param_mib']:.0f}/{r['grad_mib']:.0f}/{r['optim_mib']:.0f} | {rss[i]:.0f}"
                      for i, r in enumerate(mem))
    else:
        m = f"r0: {rss[0]:.0f} RSS (single-process path)"
    print(f"{label:<34} {ms:8.1f} {tps:8.0f} {tps / base:6.0%}   {m}")
PY

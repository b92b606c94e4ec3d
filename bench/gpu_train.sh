#!/usr/bin/env bash
# GPT-2 124M training speed on one GPU, back to back: anneal (`anneal train --device
# cuda`, bf16, on the KJV token shards of scripts/gpu-pack.sh), PyTorch eager and
# torch.compile (bench/torch_gpt2_cuda.py: the same model, random tokens), T = 1024,
# B = 32 and, time permitting, 64. Per run: median ms/step after the warm-up steps,
# tokens/s, the first step's time, peak GPU memory (anneal: the allocator's reserved bytes
# from its step log; every run: nvidia-smi's memory.used sampled every 200 ms, which
# includes the CUDA context), and MFU against the H100 SXM's dense bf16 spec (989 TFLOP/s)
# and against a bf16 matmul peak measured here with PyTorch (8192^3).
# Usage: bash bench/gpu_train.sh OUTDIR [SECONDS]      (run by scripts/gpu-check.sh)
# Env: ANNEAL_BIN (default .gpu-pack/bin/anneal, else build-gpu/anneal), ANNEAL_LIBS
# (LD_LIBRARY_PATH for anneal only), DATA (default .gpu-pack/kjv), STEPS (anneal, 12),
# TORCH_STEPS (10), DRY_RUN=1 (print the commands only).
# Writes OUTDIR/bench_anneal.log and OUTDIR/bench_torch.log; prints one line per run and
# a RESULT json line each.
set -u
cd "$(dirname "$0")/.." || exit 2
OUTDIR=${1:-bench-gpu-out}
BUDGET=${2:-330}
T0=$(date +%s)
mkdir -p "$OUTDIR"
BIN=${ANNEAL_BIN:-}
[ -n "$BIN" ] || { [ -x .gpu-pack/bin/anneal ] && BIN=.gpu-pack/bin/anneal || BIN=build-gpu/anneal; }
LIBS=${ANNEAL_LIBS:-${LD_LIBRARY_PATH:-}}
DATA=${DATA:-.gpu-pack/kjv}
TOK=${TOK:-$(dirname "$DATA")/gpt2}
STEPS=${STEPS:-12}
TORCH_STEPS=${TORCH_STEPS:-10}
SEQ=1024
SPEC_TFLOPS=989
ALOG=$OUTDIR/bench_anneal.log
TLOG=$OUTDIR/bench_torch.log
DRY=${DRY_RUN:-0}
[ "$DRY" = 1 ] || { : > "$ALOG"; : > "$TLOG"; }
PEAK=""

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
box() { local l; l=$(( $(left) - 5 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }

# nvidia-smi's memory.used, sampled until smi_stop; smi_peak prints the max in MiB
SMI_PID=""
smi_start() {
  : > "/tmp/gpu_train_smi.txt"
  (command -v nvidia-smi >/dev/null && exec nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 \
     > /tmp/gpu_train_smi.txt 2>/dev/null) &
  SMI_PID=$!
}
smi_stop() { [ -n "$SMI_PID" ] && kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; SMI_PID=""; }
smi_peak() { sort -n /tmp/gpu_train_smi.txt 2>/dev/null | tail -1; }

# the bf16 matmul peak PyTorch reaches here (TFLOP/s), for the second MFU figure
measure_peak() {
  local t
  t=$(box 40)
  [ "$t" -ge 15 ] || return
  if [ "$DRY" = 1 ]; then echo "(dry run) python3 -c '<bf16 8192^3 matmul peak>'"; return; fi
  PEAK=$(timeout -k 5 "$t" python3 - <<'EOF' 2>>"$TLOG" | tail -1
import torch, time
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3): a @ b
torch.cuda.synchronize()
t = time.perf_counter(); n = 20
for _ in range(n): a @ b
torch.cuda.synchronize()
print(round(2 * 8192**3 * n / (time.perf_counter() - t) / 1e12, 1))
EOF
)
  if [ -n "$PEAK" ]; then
    echo "measured bf16 matmul peak (PyTorch, 8192^3): $PEAK TFLOP/s; spec $SPEC_TFLOPS" | tee -a "$TLOG"
  else
    PEAK=750
    echo "bf16 matmul peak: not measured here; using 750 TFLOP/s (issue 11's H100 figure of 2026-11-24); spec $SPEC_TFLOPS" | tee -a "$TLOG"
  fi
}

# anneal train at batch B
anneal_run() {
  local B=$1 t run rc
  t=$(box "$2")
  run=/tmp/gpu_train_anneal_b$B
  local cmd=("$BIN" train --device cuda --model 124M --data "$DATA" --batch "$B" --seq "$SEQ" --dtype bf16
             --steps "$STEPS" --warmup 2 --lr 6e-4 --eval-batches 0 --ckpt-every 0 --keep 1 --log-every 1
             --peak-gflops $((SPEC_TFLOPS * 1000)) --memory-report --out "$run")
  # prepare.json names the tokenizer by the path it had on the packing machine
  [ -f "$TOK/encoder.json" ] && cmd+=(--tokenizer "$TOK")
  if [ "$DRY" = 1 ]; then echo "(dry run) LD_LIBRARY_PATH=$LIBS timeout $t ${cmd[*]}"; return; fi
  if [ "$t" -lt 30 ]; then echo "anneal B=$B: NOT RUN (out of time)"; return; fi
  rm -rf "$run"
  echo "== anneal B=$B (timeout ${t}s): ${cmd[*]}" >> "$ALOG"
  smi_start
  local s0; s0=$(date +%s.%N)
  LD_LIBRARY_PATH="$LIBS" timeout -k 5 "$t" "${cmd[@]}" >> "$ALOG" 2>&1
  rc=$?
  local wall; wall=$(python3 -c "import time; print(round(time.time() - $s0, 1))")
  smi_stop
  local smi; smi=$(smi_peak)
  RUN="$run" B="$B" SEQ="$SEQ" RC="$rc" WALL="$wall" SMI="${smi:-}" PEAK="${PEAK:-}" SPEC="$SPEC_TFLOPS" python3 - <<'EOF' | tee -a "$ALOG"
import json, os, statistics
run, B, T = os.environ["RUN"], int(os.environ["B"]), int(os.environ["SEQ"])
rc, wall, smi = os.environ["RC"], os.environ["WALL"], os.environ["SMI"]
peak, spec = os.environ["PEAK"], float(os.environ["SPEC"])
recs = []
try:
    for line in open(os.path.join(run, "log.jsonl")):
        try: recs.append(json.loads(line))
        except ValueError: pass
except OSError:
    pass
start = next((r for r in recs if r.get("type") == "start"), {})
steps = [r for r in recs if r.get("type") == "step"]
summ = next((r for r in recs if r.get("type") == "summary"), {})
if not steps:
    err = summ.get("error") or f"no step logged (exit {rc}{', timed out' if rc in ('124', '137') else ''}; see bench_anneal.log)"
    print(f"anneal        B={B}: FAILED: {err}")
else:
    ms = [s["ms"] for s in steps]
    timed = ms[2:] if len(ms) > 3 else ms[1:] or ms
    med = statistics.median(timed)
    tok = B * T / (med / 1000)
    fpt = start.get("flops_per_token") or 855e6
    mem = max(s.get("memory_bytes", 0) for s in steps) / 2**30
    tflops = tok * fpt / 1e12
    mfu_m = f"{100 * tflops / float(peak):.1f}%" if peak else "?"
    res = dict(trainer="anneal", B=B, T=T, steps=len(steps), step_ms_median=round(med, 2), step_ms_min=round(min(timed), 2),
               step_ms_max=round(max(timed), 2), first_step_s=round(ms[0] / 1000, 2), tokens_per_s=round(tok),
               tflops=round(tflops, 1), mfu_spec=round(tflops / spec, 4), mfu_measured=(round(tflops / float(peak), 4) if peak else None),
               peak_mem_gib_allocator=round(mem, 2), peak_mem_mib_nvidia_smi=(int(smi) if smi else None),
               loss_first=round(steps[0]["loss"], 3), loss_last=round(steps[-1]["loss"], 3), wall_s=float(wall),
               exit=int(rc), error=summ.get("error"))
    print(f"anneal        B={B}: {tok/1e3:7.1f}K tok/s, {med:7.1f} ms/step (median of {len(timed)}), first step {ms[0]/1000:.2f} s, "
          f"peak mem {mem:.2f} GiB (allocator) / {smi or '?'} MiB (nvidia-smi), {tflops:.0f} TFLOP/s = MFU {100*tflops/spec:.1f}% of {spec:.0f} spec, "
          f"{mfu_m} of measured; loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}" + (f"; exit {rc}: {summ.get('error')}" if summ.get("error") else ""))
    print("RESULT " + json.dumps(res))
EOF
}

# PyTorch at batch B, eager or compiled
torch_run() {
  local B=$1 mode=$2 t rc
  t=$(box "$3")
  local cmd=(python3 bench/torch_gpt2_cuda.py --B "$B" --T "$SEQ" --steps "$TORCH_STEPS" --warmup 3 --tag "$mode")
  [ "$mode" = compile ] && cmd+=(--compile)
  if [ "$DRY" = 1 ]; then echo "(dry run) timeout $t ${cmd[*]}"; return; fi
  if [ "$t" -lt 30 ]; then echo "torch $mode B=$B: NOT RUN (out of time)"; return; fi
  echo "== torch $mode B=$B (timeout ${t}s): ${cmd[*]}" >> "$TLOG"
  smi_start
  PYTHONUNBUFFERED=1 timeout -k 5 "$t" "${cmd[@]}" > /tmp/gpu_train_torch.txt 2>&1
  rc=$?
  smi_stop
  cat /tmp/gpu_train_torch.txt >> "$TLOG"
  local smi; smi=$(smi_peak)
  B="$B" MODE="$mode" RC="$rc" SMI="${smi:-}" PEAK="${PEAK:-}" SPEC="$SPEC_TFLOPS" python3 - <<'EOF' | tee -a "$TLOG"
import json, os
B, mode, rc, smi = os.environ["B"], os.environ["MODE"], os.environ["RC"], os.environ["SMI"]
peak, spec = os.environ["PEAK"], float(os.environ["SPEC"])
res = None
for line in open("/tmp/gpu_train_torch.txt", errors="replace"):
    if line.startswith("RESULT "):
        res = json.loads(line[7:])
name = f"torch {mode}".ljust(13)
if not res:
    print(f"{name} B={B}: FAILED (exit {rc}{', timed out' if rc in ('124', '137') else ''}; see bench_torch.log)")
else:
    tf = res["tflops"]
    mfu_m = f"{100 * tf / float(peak):.1f}%" if peak else "?"
    print(f"{name} B={B}: {res['tokens_per_s']/1e3:7.1f}K tok/s, {res['step_ms_median']:7.1f} ms/step (median), first step {res['first_step_s']:.2f} s, "
          f"peak mem {res['peak_mem_gib']:.2f} GiB (torch allocator) / {smi or '?'} MiB (nvidia-smi), {tf:.0f} TFLOP/s = MFU {100*tf/spec:.1f}% of {spec:.0f} spec, "
          f"{mfu_m} of measured; {res['torch']} on {res['gpu']}")
    res.update(trainer=f"torch {mode}", peak_mem_mib_nvidia_smi=(int(smi) if smi else None), mfu_spec=round(tf / spec, 4),
               mfu_measured=(round(tf / float(peak), 4) if peak else None))
    print("RESULT " + json.dumps(res))
EOF
}

echo "benchmark: GPT-2 124M, T=$SEQ, bf16, AdamW; anneal $BIN on $DATA ($STEPS steps), PyTorch ($TORCH_STEPS timed steps after 3); budget ${BUDGET}s"
[ -x "$BIN" ] || echo "anneal: $BIN is missing"
[ -d "$DATA" ] || echo "anneal: no shards at $DATA"
measure_peak
anneal_run 32 90
torch_run 32 eager 70
torch_run 32 compile 130
anneal_run 64 80
echo "benchmark: done in $(( $(date +%s) - T0 ))s"

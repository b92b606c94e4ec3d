#!/usr/bin/env bash
# The GPU machine's host CPU (issues 17 and 13): a 16-core server CPU, where AMX may be
# exposed. Run by scripts/gpu-check.sh (step H) with the packed programs; in order, each
# step in its own time box so that every one gets its turn:
#   1. lscpu, `anneal info` (the kernel path of each op and why)
#   2. the CPU tests whose kernels differ by ISA (the AMX bf16 and int8 tiles, the GEMM
#      drivers, attention, the int8 panels, quantized models, GPT-2 against its fixtures)
#   3. `anneal bench peak` fp32 and bf16 at 2 threads and at all cores (bf16: AMX tiles
#      where present, the MFU ceiling)
#   4. bench/bench_train.py at 2 threads (GPT-2 124M and d6, B8 T256): anneal fp32/bf16
#      against the machine's PyTorch fp32/bf16 autocast, back to back
#   5. int8, batch 1, 2 threads: bench_quant (prompt 512, decode 64) on the tiles against
#      ANNEAL_ISA=avx512bf16 (VPDPBUSD), then bench/quant_speed.py against PyTorch's
#      quantize_dynamic on the same weights
#   6. per-op profiles of a GPT-2 124M bf16 training step (`anneal bench step --profile`,
#      B8 T256 at 2 threads, B16 at all cores), and int8 prompts on the tiles against
#      VPDPBUSD alternated three times (bench_quant)
#   7. bench/bench_train.py at all cores, B16 (124M and d6)
#   ab: this anneal against OLD_BIN (an earlier build, same libraries), alternated: the
#      124M bf16 step's per-op profile at 2 threads (new, old, new) and at all cores (new,
#      old), into host_ab.log
#   torch: bench/torch_gpt2.py bf16 autocast, the same 124M steps at 2 threads (B8) and at
#      all cores (B16), into host_ab.log
# Usage: bash scripts/host-check.sh OUTDIR [SECONDS]
# Env: BIN_DIR (default .gpu-pack/bin: anneal, the tests, bench_quant), ANNEAL_LIBS
# (LD_LIBRARY_PATH for those programs only: Python keeps the machine's own libraries),
# PY (a python3 with torch and transformers; default python3), CONFIGS (bench_train's,
# default 124M,d6), QMODEL and QPROMPT (the int8 model's preset and prompt, default 124M
# and 512): tiny ones for a rehearsal on a small machine; HOST_STEPS (default "tests peaks
# train2 int8 train16"; also "profile int8ab ab torch") picks the steps, CONFIGS16 the
# configs at all cores (default CONFIGS), OLD_BIN an earlier anneal for step "ab".
# Writes OUTDIR/host_cpu.log (1-3) and host_bench.log (4-6), and appends its figures to
# OUTDIR/summary.txt. The default steps take about 9 minutes on the 16-core host
# (2026-11-30: training at 2 threads with PyTorch about 4 of them), so on a 15-minute
# device budget run them alone:
#   run(command="GPU_CHECK_SECONDS=560 bash scripts/gpu-check.sh --no-bench", carry=[".gpu-pack"], timeout_s=600)
# and give each box (T2_SECONDS, T16_SECONDS) less, or fewer CONFIGS, to leave a rerun.
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
OUTDIR=${1:-host-check-out}
BUDGET=${2:-400}
T0=$(date +%s)
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
BIN_DIR=${BIN_DIR:-$ROOT/.gpu-pack/bin}
PY=${PY:-python3}
CONFIGS=${CONFIGS:-124M,d6}
QMODEL=${QMODEL:-124M}
QPROMPT=${QPROMPT:-512}
HOST_STEPS=${HOST_STEPS:-tests peaks train2 int8 train16}
CONFIGS16=${CONFIGS16:-$CONFIGS}
want() { case " $HOST_STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
SUM=$OUTDIR/summary.txt
HLOG=$OUTDIR/host_cpu.log
TLOG=$OUTDIR/host_bench.log
QLOG=$TLOG
: > "$TLOG"
NCPU=$(nproc)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# box WANT: WANT seconds, or what is left (minus a margin) if less
box() { local l; l=$(( $(left) - 5 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
say() { echo "$*" | tee -a "$SUM"; }
stamp() { printf '[host %4ds] ' $(( $(date +%s) - T0 )); }

# wrappers that give anneal's programs their libraries (and nothing else)
for b in anneal bench_quant; do
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s/%s" "$@"\n' "${ANNEAL_LIBS:-}" "$BIN_DIR" "$b" > "$WORK/$b"
  chmod +x "$WORK/$b"
done
A=$WORK/anneal

# ------------------------------------------------------------------ 1. the machine
{ echo "== lscpu"; lscpu; echo "== anneal info"; timeout 30 "$A" info; } > "$HLOG" 2>&1
MODEL=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
AMX=$(grep -o -w 'amx_[a-z0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')
say "$(stamp)host CPU: $MODEL, $NCPU cpus, amx flags: ${AMX:-none}; $(grep -o -w 'avx512_bf16\|avx512_fp16\|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
grep -E '^(isa|bf16|gemm|int8|matmul|attention)' "$HLOG" | head -12 | sed 's/^/    info: /' | tee -a "$SUM"

# ------------------------------------------------------------------ 2. the tests
TESTS="cpu_test_gemm_amx cpu_test_gemm_int8 cpu_test_kernel_paths cpu_test_gemm cpu_test_gemm_precision
  cpu_test_attention cpu_test_gemv_panels ops_test_quant_ops io_test_quant_model models_test_gpt2"
want tests || TESTS=""
for t in $TESTS; do
  [ -x "$BIN_DIR/$t" ] || { say "    $t: not packed"; continue; }
  tb=$(box 60)
  [ "$tb" -ge 10 ] || { say "    $t: NOT RUN (out of time)"; continue; }
  echo "== $t (OMP_NUM_THREADS=$NCPU, timeout ${tb}s)" >> "$HLOG"
  ANNEAL_SOURCE_DIR=$ROOT OMP_NUM_THREADS=$NCPU LD_LIBRARY_PATH=${ANNEAL_LIBS:-} \
    timeout -k 5 "$tb" "$BIN_DIR/$t" > "$WORK/t.log" 2>&1
  rc=$?
  cat "$WORK/t.log" >> "$HLOG"
  echo "== exit $rc" >> "$HLOG"
  case $rc in 0) v=PASSED ;; 77) v=SKIPPED ;; 124|137) v="TIMED OUT" ;; *) v="FAILED (exit $rc)" ;; esac
  say "$(stamp)$t: $v: $(grep -E '^[0-9]+ passed' "$WORK/t.log" | tail -1)"
  grep -E 'FAIL|SKIP' "$WORK/t.log" | head -8 | cut -c1-220 | sed 's/^/      /' | tee -a "$SUM"
done

# ------------------------------------------------------------------ 3. the peaks
want peaks && for th in $(printf '2\n%s\n' "$NCPU" | sort -un); do
  for dt in fp32 bf16; do
    tb=$(box 30)
    [ "$tb" -ge 8 ] || continue
    echo "== bench peak --dtype $dt --threads $th" >> "$HLOG"
    line=$(timeout -k 5 "$tb" "$A" bench peak --dtype "$dt" --threads "$th" --seconds 1 2>&1 | tail -1)
    echo "$line" >> "$HLOG"
    say "$(stamp)peak $dt, $th threads: $line"
  done
done

# ------------------------------------------------ 4. and 6. training, side by side
train() { # THREADS BATCH WANT_SECONDS CONFIGS
  local th=$1 b=$2 cf=$4 tb
  tb=$(box "$3")
  if [ "$tb" -lt 30 ]; then say "training at $th threads: NOT RUN (out of time)"; return; fi
  say "$(stamp)bench_train.py: $th threads, B$b, $cf (timeout ${tb}s)"
  echo "======== bench_train.py --threads $th --batch $b" >> "$TLOG"
  timeout -k 5 "$tb" "$PY" bench/bench_train.py --anneal "$A" --configs "$cf" --rounds 1 --steps 2 --warmup 1 \
    --threads "$th" --batch "$b" --recompute off --torch-python "$PY" --torch2 off --peak-seconds 0.5 \
    --timeout $(( tb / 3 )) --json "$WORK/train_$th.json" >> "$TLOG" 2>&1
  echo "== exit $?" >> "$TLOG"
  [ -f "$WORK/train_$th.json" ] && { echo "== json"; cat "$WORK/train_$th.json"; echo; } >> "$TLOG"
  awk -v h="======== bench_train.py --threads $th --batch $b" '$0 == h {on = 1} on && /^== json/ {on = 0} on' "$TLOG" \
    | grep -E '^\||^- |^== exit' | grep -v '^|--' | head -30 | sed 's/^/    /' >> "$SUM"
}
want train2 && train 2 8 "${T2_SECONDS:-240}" "$CONFIGS"

# -------------------------------------------------- 5. int8, batch 1, 2 threads
tq=$(box 100)
if ! want int8; then
  :
elif [ "$tq" -ge 40 ]; then
  say "$(stamp)int8 (timeout ${tq}s)"
  export A WORK PY QMODEL QPROMPT
  # under timeout, in its own process group: bench_quant and Python go with it
  STEP_Q='
    set -e
    "$A" export --model "$QMODEL" --format hf --out "$WORK/hf" > /dev/null
    "$A" quantize --model "$WORK/hf" --out "$WORK/q" --mode dynamic > /dev/null
    echo "== bench_quant q $QPROMPT 64 2 3 bf16 (AMX where the CPU has it)"
    "$WORK/bench_quant" "$WORK/q" "$QPROMPT" 64 2 3 bf16
    echo "== bench_quant q $QPROMPT 64 2 3 bf16, ANNEAL_ISA=avx512bf16 (VPDPBUSD)"
    ANNEAL_ISA=avx512bf16 "$WORK/bench_quant" "$WORK/q" "$QPROMPT" 64 2 3 bf16
    rm -rf "$WORK/hf" "$WORK/q"
    echo "== bench/quant_speed.py --threads 2 --rounds 2 --decode 32"
    PYTHONUNBUFFERED=1 "$PY" bench/quant_speed.py --bin "$A" --bench "$WORK/bench_quant" --model "$QMODEL" \
      --prompt "$QPROMPT" --threads 2 --rounds 2 --decode 32
  '
  echo "======== int8" >> "$QLOG"
  timeout -k 5 "$tq" bash -c "$STEP_Q" > "$WORK/q.log" 2>&1
  echo "== exit $?" >> "$WORK/q.log"
  cat "$WORK/q.log" >> "$QLOG"
  grep -E 'ANNEAL_ISA|AMX|prefill|tok/s|quantize_dynamic|anneal int8|torch|exit' "$WORK/q.log" | grep -v Warning | head -20 \
    | sed 's/^/    /' | tee -a "$SUM"
else
  say "int8: NOT RUN (out of time)"
fi

# ------------------------------------- 6. profiles, and int8 on the tiles against VPDPBUSD
# step_profile LABEL BIN THREADS BATCH LOG: the 124M bf16 step profiled, into LOG; its
# step time, parallel fraction and product rates into the summary
step_profile() {
  local t log=$5
  t=$(box 60)
  [ "$t" -ge 20 ] || { say "ab $1 at $3 threads: NOT RUN (out of time)"; return; }
  echo "======== $1: bench step --model 124M --batch $4 --seq 256 --dtype bf16 --profile, $3 threads" >> "$log"
  OMP_NUM_THREADS=$3 LD_LIBRARY_PATH=${ANNEAL_LIBS:-} timeout -k 5 "$t" "$2" bench step --model "${AB_MODEL:-124M}" --batch "$4" \
    --seq 256 --steps 2 --warmup 1 --dtype bf16 --profile --trace "$WORK/trace.json" > "$WORK/ab.out" 2>&1
  echo "== exit $?" >> "$WORK/ab.out"
  cat "$WORK/ab.out" >> "$log"
  say "$(stamp)ab $1, $3 threads, B$4: $(grep '^step ' "$WORK/ab.out" | tail -1 | cut -c1-60); $(grep -o '^parallel fraction [0-9.]*' "$WORK/ab.out"); matmul $(grep -E '^  matmul' "$WORK/ab.out" | awk '{printf "%s %s GFLOP/s; ", $2, $(NF-2)}')lce $(grep -E '^  linear_cross' "$WORK/ab.out" | awk '{print $(NF-2)}')"
}
if want profile; then
  PLOG=$OUTDIR/host_profile.log
  : > "$PLOG"
  step_profile profile "$BIN_DIR/anneal" 2 8 "$PLOG"
  step_profile profile "$BIN_DIR/anneal" "$NCPU" 16 "$PLOG"
fi
tq=$(box 60)
if want int8ab && [ "$tq" -ge 30 ]; then
  export A WORK QMODEL QPROMPT
  STEP_AB='
    "$A" export --model "$QMODEL" --format hf --out "$WORK/hf" > /dev/null &&
    "$A" quantize --model "$WORK/hf" --out "$WORK/qab" --mode dynamic > /dev/null || exit 1
    for r in 1 2 3; do
      echo "tiles $("$WORK/bench_quant" "$WORK/qab" "$QPROMPT" 8 2 3 bf16)"
      echo "vpdpbusd $(ANNEAL_ISA=avx512bf16 "$WORK/bench_quant" "$WORK/qab" "$QPROMPT" 8 2 3 bf16)"
    done
  '
  echo "======== int8 prompts, tiles vs VPDPBUSD alternated (bench_quant q $QPROMPT 8 2 3 bf16)" >> "$QLOG"
  timeout -k 5 "$tq" bash -c "$STEP_AB" > "$WORK/ab.log" 2>&1
  echo "== exit $?" >> "$WORK/ab.log"
  cat "$WORK/ab.log" >> "$QLOG"
  sed 's/^/    int8 /' "$WORK/ab.log" | tee -a "$SUM"
fi

want train16 && train "$NCPU" 16 "${T16_SECONDS:-150}" "$CONFIGS16"

# -------------------------- ab: this build against an earlier one; torch: PyTorch's step
ALOG=$OUTDIR/host_ab.log
if want ab; then
  if [ -n "${OLD_BIN:-}" ] && [ -x "$OLD_BIN" ]; then
    step_profile new "$BIN_DIR/anneal" 2 8 "$ALOG"
    step_profile old "$OLD_BIN" 2 8 "$ALOG"
    step_profile new "$BIN_DIR/anneal" 2 8 "$ALOG"
    step_profile new "$BIN_DIR/anneal" "$NCPU" 16 "$ALOG"
    step_profile old "$OLD_BIN" "$NCPU" 16 "$ALOG"
  else
    say "ab: no OLD_BIN"
  fi
fi
if want torch; then
  for tb in "2 8" "$NCPU 16"; do
    set -- $tb
    t=$(box 60)
    [ "$t" -ge 20 ] || { say "torch at $1 threads: NOT RUN (out of time)"; continue; }
    echo "======== torch_gpt2.py --dtype bf16 --threads $1 --batch $2 --seq 256 --steps 3" >> "$ALOG"
    timeout -k 5 "$t" "$PY" bench/torch_gpt2.py --dtype bf16 --threads "$1" --batch "$2" --seq 256 --steps 3 \
      > "$WORK/t.out" 2>&1
    echo "== exit $?" >> "$WORK/t.out"
    cat "$WORK/t.out" >> "$ALOG"
    say "$(stamp)torch bf16, $1 threads, B$2: $(grep -o '"median_ms": [0-9.]*\|"tokens_per_s": [0-9.]*' "$WORK/t.out" | tr '\n' ' ')"
  done
fi
say "$(stamp)host-check done"

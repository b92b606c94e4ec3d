#!/usr/bin/env bash
# The GPU check: one command, run on the machine with the GPU from the repository root,
# that reports the machine, finds cuBLASLt, optionally builds there, runs the GPU tests
# and the training benchmark (anneal vs PyTorch eager and torch.compile), and writes
# everything into one flat folder (at most 8 files):
#   summary.txt         what ran, what passed, what failed, the benchmark's figures
#   env.txt             nvidia-smi, nvcc, gcc, cmake, torch, where the libraries were found
#   build.log           step A (only with --build)
#   test_cuda_ops.log   step B: every CUDA slot against the CPU's
#   test_cuda_gpt2.log  step B: GPT-2 on the GPU next to a CPU twin
#   bench_anneal.log    step C: anneal train on GPT-2 124M (bench/gpu_train.sh)
#   bench_torch.log     step C: PyTorch eager and compiled (bench/torch_gpt2_cuda.py)
#   host_cpu.log        step H (scripts/host-check.sh): the host CPU: lscpu, anneal info, the CPU
#                       tests whose kernels differ by ISA (the AMX tiles among them), the peaks
#   host_bench.log      step H: training against PyTorch at 2 threads and all cores, int8 on the
#                       tiles against VPDPBUSD and against quantize_dynamic
# What it needs from this machine's side: .gpu-pack/ (scripts/gpu-pack.sh: the binaries,
# their libraries, the KJV shards, the -dev .debs), carried with the call:
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu-pack"], timeout_s=600)
# Usage: bash scripts/gpu-check.sh [--build] [--no-tests] [--no-bench] [--no-host] [--dry-run] [OUTDIR]
#   OUTDIR      default $OUT (the device tool's folder), else ./gpu-check-out
#   --build     step A: build from the tree there (the carried .debs unpacked with dpkg -x
#               into a prefix under /tmp, never into /) and test those binaries instead of
#               the packed ones (a build that fails falls back to the packed ones)
#   --no-bench  skip step C; --no-tests step B; --no-host step H
#   --dry-run   no GPU needed: the environment report, the library search, the .debs'
#               unpacking and (with --build) the configure step; prints the commands of
#               steps B and C instead of running them
# Every step has a timeout, and the whole script keeps within GPU_CHECK_SECONDS (470 by
# default): a step gets what is left when its turn comes. Exit 0 when anything ran
# (failed tests are in summary.txt), 2 when nothing could run.
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
T0=$(date +%s)
BUDGET=${GPU_CHECK_SECONDS:-470}
DO_BUILD=0 DO_TESTS=1 DO_BENCH=1 DO_HOST=1 DRY=0 OUTDIR=""
for a in "$@"; do
  case "$a" in
    --build) DO_BUILD=1 ;;
    --no-tests) DO_TESTS=0 ;;
    --no-bench) DO_BENCH=0 ;;
    --no-host) DO_HOST=0 ;;
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    -*) echo "gpu-check: unknown flag $a" >&2; exit 2 ;;
    *) OUTDIR=$a ;;
  esac
done
OUTDIR=${OUTDIR:-${OUT:-$ROOT/gpu-check-out}}
mkdir -p "$OUTDIR" || exit 2
OUTDIR=$(cd "$OUTDIR" && pwd)
SUM=$OUTDIR/summary.txt
ENVF=$OUTDIR/env.txt
: > "$SUM"
: > "$ENVF"
PACK=$ROOT/.gpu-pack
# the programs and libraries travel as xz archives (scripts/gpu-pack.sh): unpacked here once
for a in bin lib; do
  [ -f "$PACK/$a.tar.xz" ] && [ ! -d "$PACK/$a" ] || continue
  tar xJf "$PACK/$a.tar.xz" -C "$PACK" 2>/dev/null \
    || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$PACK/$a.tar.xz" "$PACK" \
    || echo "gpu-check: $PACK/$a.tar.xz did not unpack" >&2
done
RAN=0

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# box WANT: the seconds a step may take: WANT, or what is left (minus a margin) if less
box() { local l; l=$(( $(left) - 8 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
say() { echo "$*" | tee -a "$SUM"; }
stamp() { printf '[%4ds] ' $(( $(date +%s) - T0 )); }

say "gpu-check $(date -u +%FT%TZ) in $ROOT (budget ${BUDGET}s; output $OUTDIR)"
[ -f "$PACK/MANIFEST" ] && say "pack: $(head -1 "$PACK/MANIFEST")" || say "pack: none (.gpu-pack missing: run scripts/gpu-pack.sh here and carry .gpu-pack)"
say "tree: $(git log -1 --format='%h %s' 2>/dev/null | cut -c1-100 || echo '?')"

# ------------------------------------------------------------ the machine
{
  echo "== uname"; uname -a
  echo "== cpus"; nproc
  echo "== nvidia-smi"; timeout 20 nvidia-smi 2>&1 || echo "(nvidia-smi failed or missing)"
  echo "== nvcc"; (command -v nvcc >/dev/null && nvcc --version) || /usr/local/cuda/bin/nvcc --version 2>&1 || echo "(no nvcc)"
  echo "== gcc"; gcc --version 2>&1 | head -1
  echo "== cmake"; cmake --version 2>&1 | head -1
  echo "== pkg-config"; pkg-config --version 2>&1
  echo "== python3 / torch"
  timeout 60 python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and torch.cuda.get_device_name())' 2>&1 | tail -1
} > "$ENVF" 2>&1
GPU_NAME=$(timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
say "gpu: ${GPU_NAME:-none found by nvidia-smi}"
say "nvcc: $( (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | grep -o 'release [0-9.]*' | head -1)"

# ------------------------------------------ cuBLASLt and the packed libraries
find_cublaslt() {
  local d
  for d in /usr/local/cuda/lib64 /usr/local/cuda*/lib64 /usr/local/cuda*/targets/x86_64-linux/lib; do
    [ -e "$d/libcublasLt.so.13" ] && { echo "$d"; return 0; }
  done
  local p
  p=$(ldconfig -p 2>/dev/null | awk '/libcublasLt\.so\.13 /{print $NF; exit}')
  [ -n "$p" ] && { dirname "$p"; return 0; }
  local sp
  for sp in $(timeout 30 python3 -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
    for d in "$sp/nvidia/cu13/lib" "$sp/nvidia/cublas/lib"; do
      [ -e "$d/libcublasLt.so.13" ] && { echo "$d"; return 0; }
    done
    p=$(find "$sp/nvidia" -maxdepth 4 -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
    [ -n "$p" ] && { dirname "$p"; return 0; }
  done
  return 1
}
CUBLAS_DIR=$(find_cublaslt)
if [ -n "$CUBLAS_DIR" ]; then say "cublasLt: $CUBLAS_DIR/libcublasLt.so.13"; else say "cublasLt: libcublasLt.so.13 NOT FOUND"; fi
ANNEAL_LIBS="$PACK/lib${CUBLAS_DIR:+:$CUBLAS_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# the packed libraries go to anneal's programs only (python and the system keep their own)
with_libs() { LD_LIBRARY_PATH="$ANNEAL_LIBS" "$@"; }

BIN_DIR=$PACK/bin
check_bins() { # DIR -> prints unresolved libraries of its programs
  local b
  for b in "$1"/anneal "$1"/cuda_test_cuda_ops "$1"/cuda_test_cuda_gpt2; do
    [ -x "$b" ] || { echo "  $b: missing"; continue; }
    with_libs ldd "$b" 2>&1 | grep 'not found' | sed "s|^|  $(basename "$b"): |"
  done
}
{ echo "== unresolved libraries of the packed programs (LD_LIBRARY_PATH=$ANNEAL_LIBS)"; check_bins "$BIN_DIR"; } >> "$ENVF"
unresolved=$(check_bins "$BIN_DIR" | grep -c 'not found\|missing')
say "packed programs: $( [ "$unresolved" = 0 ] && echo 'every library resolves' || echo "$unresolved unresolved (env.txt)")"

# ------------------------------------------------------- step A: a build there
if [ "$DO_BUILD" = 1 ]; then
  BLOG=$OUTDIR/build.log
  PREFIX=/tmp/anneal-gpu-deps
  tb=$(box 300)
  say "$(stamp)step A: build from the tree (timeout ${tb}s), -dev packages unpacked into $PREFIX"
  export ROOT PACK PREFIX DRY CUBLAS_DIR
  # run under timeout (its own process group: cmake, make and nvcc go with it)
  STEP_A='
    set -e
    rm -rf "$PREFIX"; mkdir -p "$PREFIX"
    n=0
    for d in "$PACK"/debs/*.deb; do dpkg -x "$d" "$PREFIX"; n=$((n + 1)); done
    echo "unpacked $n packages into $PREFIX"
    LIBDIR=$PREFIX/usr/lib/x86_64-linux-gnu
    mkdir -p "$LIBDIR"
    # the -dev packages libX.so links point at the runtime libraries: the packed ones
    for f in "$PACK"/lib/*; do [ -e "$LIBDIR/$(basename "$f")" ] || cp "$f" "$LIBDIR/"; done
    # libX.so -> libX.so.N.M.K (a runtime package not carried): point it at the packed libX.so.N
    for l in "$LIBDIR"/*.so; do
      [ -L "$l" ] && [ ! -e "$l" ] || continue
      for c in "$l".*; do [ -e "$c" ] && { ln -sf "$(basename "$c")" "$l"; break; }; done
    done
    # their .pc files say prefix=/usr: the sysroot maps every -I/-L into the prefix, and
    # only the prefix .pc files are seen
    export PKG_CONFIG_LIBDIR=$LIBDIR/pkgconfig:$PREFIX/usr/share/pkgconfig
    export PKG_CONFIG_SYSROOT_DIR=$PREFIX PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 PKG_CONFIG_ALLOW_SYSTEM_LIBS=1
    export CPATH=$PREFIX/usr/include LIBRARY_PATH=$LIBDIR
    export PATH=$PREFIX/usr/bin:$PATH:/usr/local/cuda/bin
    export LD_LIBRARY_PATH=$LIBDIR${CUBLAS_DIR:+:$CUBLAS_DIR}
    for m in libcjson libpcre2-8 libprotobuf-c libmicrohttpd cairo fontconfig; do
      echo "pkg-config $m: $(pkg-config --cflags --libs $m 2>&1)"
    done
    echo "protoc-c: $(command -v protoc-c) $(protoc-c --version 2>&1 | head -1)"
    cmake -S "$ROOT" -B "$ROOT/build-gpu-there" -DCMAKE_BUILD_TYPE=Release -DANNEAL_CUDA=ON -DANNEAL_MPI=OFF \
      -DANNEAL_CUDA_ARCHS=90 -DCMAKE_LIBRARY_PATH="$LIBDIR" -DCMAKE_INCLUDE_PATH="$PREFIX/usr/include"
    if [ "$DRY" = 1 ]; then echo "(dry run: configure only)"; exit 0; fi
    cmake --build "$ROOT/build-gpu-there" -j"$(nproc)" --target anneal_cli cuda_test_cuda_ops cuda_test_cuda_gpt2
  '
  timeout -k 10 "$tb" bash -c "$STEP_A" > "$BLOG" 2>&1
  brc=$?
  if [ "$brc" = 0 ] && [ "$DRY" = 0 ] && [ -x "$ROOT/build-gpu-there/cuda_test_cuda_ops" ]; then
    BIN_DIR=$ROOT/build-gpu-there
    RAN=1
    say "$(stamp)step A: built; testing build-gpu-there's programs"
  elif [ "$brc" = 0 ] && [ "$DRY" = 1 ]; then
    say "$(stamp)step A: dry run: unpacked and configured (build.log)"
  else
    say "$(stamp)step A: FAILED (rc $brc; build.log ends with:)"
    tail -5 "$BLOG" | sed 's/^/    /' | tee -a "$SUM"
    say "    falling back to the packed programs"
  fi
fi

if [ ! -x "$BIN_DIR/anneal" ]; then
  say "nothing to run: no packed or built programs"
  exit 2
fi
{ echo "== anneal info ($BIN_DIR/anneal)"; with_libs timeout 30 "$BIN_DIR/anneal" info 2>&1; } >> "$ENVF"

# ------------------------------------------------------------- step B: tests
run_test() { # NAME WANT_SECONDS
  local name=$1 t log rc
  t=$(box "$2")
  log=$OUTDIR/test_$name.log
  if [ "$DRY" = 1 ]; then
    say "(dry run) ANNEAL_SOURCE_DIR=$ROOT LD_LIBRARY_PATH=$ANNEAL_LIBS timeout $t $BIN_DIR/cuda_test_$name > $log"
    return
  fi
  if [ "$t" -lt 15 ]; then say "test $name: NOT RUN (out of time)"; return; fi
  say "$(stamp)test $name (timeout ${t}s)"
  ANNEAL_SOURCE_DIR=$ROOT ANNEAL_BIN=$BIN_DIR/anneal OMP_NUM_THREADS=$(nproc) \
    with_libs timeout -k 5 "$t" "$BIN_DIR/cuda_test_$name" > "$log" 2>&1
  rc=$?
  RAN=1
  local verdict
  case $rc in
    0) verdict="PASSED" ;;
    77) verdict="SKIPPED ($(grep -m1 'SKIP' "$log" | cut -c1-200))" ;;
    124|137) verdict="TIMED OUT after ${t}s" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  say "$(stamp)test $name: $verdict"
  grep -m1 '^SUMMARY' "$log" | sed 's/^/    /' | tee -a "$SUM"
  # the failing checks (first 40), then the missing kernels counted by slot
  grep -E 'FAIL$|FAIL  \[|  FAIL|call failed' "$log" | grep -v '^  FAIL .*see the FAIL line above' \
    | head -40 | sed 's/^/    /' | tee -a "$SUM"
  grep '^UNSUPPORTED' "$log" | awk '{print $2}' | sort | uniq -c \
    | awk '{printf "    UNSUPPORTED %s (%d cases)\n", $2, $1}' | tee -a "$SUM"
  grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -1 | sed 's/^/    /' | tee -a "$SUM"
  if [ "$rc" != 0 ] && [ "$rc" != 77 ]; then tail -3 "$log" | sed 's/^/    last: /' | tee -a "$SUM"; fi
}
if [ "$DO_TESTS" = 1 ]; then
  run_test cuda_ops 150
  run_test cuda_gpt2 120
fi

# --------------------------------------------------------- step C: benchmark
if [ "$DO_BENCH" = 1 ]; then
  tbench=$(box 330)
  if [ "$DRY" = 1 ]; then
    say "(dry run) ANNEAL_BIN=$BIN_DIR/anneal ANNEAL_LIBS=$ANNEAL_LIBS bash bench/gpu_train.sh $OUTDIR $tbench"
    DRY_RUN=1 ANNEAL_BIN="$BIN_DIR/anneal" ANNEAL_LIBS="$ANNEAL_LIBS" bash bench/gpu_train.sh "$OUTDIR" "$tbench" | tee -a "$SUM"
  elif [ "$tbench" -lt 40 ]; then
    say "benchmark: NOT RUN (out of time)"
  else
    say "$(stamp)benchmark (bench/gpu_train.sh, ${tbench}s)"
    ANNEAL_BIN="$BIN_DIR/anneal" ANNEAL_LIBS="$ANNEAL_LIBS" DATA="$PACK/kjv" \
      timeout -k 5 $((tbench + 5)) bash bench/gpu_train.sh "$OUTDIR" "$tbench" 2>&1 | tee -a "$SUM"
    RAN=1
  fi
fi

# ------------------------------------ step H: the host CPU (issues 17 and 13: AMX, 16 cores)
if [ "$DO_HOST" = 1 ]; then
  th=$(box 560)
  if [ "$DRY" = 1 ]; then
    say "(dry run) BIN_DIR=$BIN_DIR ANNEAL_LIBS=$ANNEAL_LIBS bash scripts/host-check.sh $OUTDIR $th"
  elif [ "$th" -lt 60 ]; then
    say "host CPU: NOT RUN (out of time)"
  else
    say "$(stamp)host CPU (scripts/host-check.sh, ${th}s)"
    BIN_DIR=$BIN_DIR ANNEAL_LIBS=$ANNEAL_LIBS timeout -k 5 $((th + 5)) bash scripts/host-check.sh "$OUTDIR" "$th"
    RAN=1
  fi
fi

say "$(stamp)done"
[ "$RAN" = 1 ] || [ "$DRY" = 1 ] || exit 2
exit 0

#!/usr/bin/env bash
# Prepares, on this machine (nvcc, no GPU), what scripts/gpu-check.sh needs on the GPU
# machine (which has no package registry and no PCRE2/cJSON/Cairo/... headers):
#   .gpu-pack/bin/     anneal, the tests/cuda test binaries, the host CPU's tests and bench_quant
#                      (CUDA build, Release, build-gpu/), carried as bin.tar.xz
#   .gpu-pack/lib/     (carried as lib.tar.xz) every shared library they need that the GPU machine's own system
#                      does not give (ldd, minus glibc, libstdc++, libgcc, the driver's
#                      libcuda and the toolkit's cuBLAS/cuBLASLt)
#   .gpu-pack/kjv/     token shards of the King James Bible (Debian's bible-kjv,
#                      `bible gen1:1-rev22:21`) prepared with the GPT-2 tokenizer
#   .gpu-pack/gpt2/    the GPT-2 tokenizer files (encoder.json, vocab.bpe)
#   .gpu-pack/debs/    the Debian -dev packages a build there needs (apt-get download), for
#                      gpu-check.sh --build to unpack with dpkg -x into a prefix under /tmp
#   .gpu-pack/MANIFEST what is in it, with the commit it was built from
# .gpu-pack is git-ignored; the device call carries it (run's carry: [".gpu-pack"]).
# Usage: bash scripts/gpu-pack.sh   (JOBS=2 by default; PACK_ARCHS=90 by default (sm_90
#   device code only: the pack is for the H100); PACK_MPI=ON keeps MPI; PACK_NO_BUILD=1
#   packs an existing build-gpu; PACK_REFETCH=1 downloads the .debs again)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD:-build-gpu}
PACK=.gpu-pack
JOBS=${JOBS:-2}
MPI=${PACK_MPI:-OFF}
ARCHS=${PACK_ARCHS:-90} # the H100's device code only (halves the fatbins; CI builds 80;90)
# after the two GPU tests: the host CPU's (scripts/host-check.sh: AMX, the GEMM drivers, int8)
TESTS="cuda_test_cuda_ops cuda_test_cuda_gpt2 cpu_test_gemm_amx cpu_test_gemm_int8 cpu_test_kernel_paths cpu_test_gemm
  cpu_test_gemm_precision cpu_test_attention cpu_test_gemv_panels ops_test_quant_ops io_test_quant_model models_test_gpt2
  bench_quant"
say() { printf '== %s\n' "$*"; }

command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "gpu-pack: no nvcc here" >&2; exit 1; }
export PATH=$PATH:/usr/local/cuda/bin

# 1. the CUDA build (Release; MPI off unless PACK_MPI=ON: one GPU, and a packed libmpi
#    would meet the GPU machine's own OpenMPI plugins)
if [ -z "${PACK_NO_BUILD:-}" ]; then
  say "build: $BUILD (Release, ANNEAL_CUDA=ON, archs $ARCHS, ANNEAL_MPI=$MPI)"
  mkdir -p "$BUILD"
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DANNEAL_CUDA=ON -DANNEAL_CUDA_ARCHS="$ARCHS" -DANNEAL_MPI="$MPI" \
    > "$BUILD/configure.log" 2>&1 \
    || { tail -20 "$BUILD/configure.log" >&2; exit 1; }
  nice cmake --build "$BUILD" -j"$JOBS" --target anneal_cli $TESTS
fi
for b in anneal $TESTS; do [ -x "$BUILD/$b" ] || { echo "gpu-pack: $BUILD/$b missing" >&2; exit 1; }; done

rm -rf "$PACK.tmp"
mkdir -p "$PACK.tmp"/{bin,lib,gpt2,debs}

# 2. binaries (symbols stripped: the device code's fatbins stay)
say "binaries"
for b in anneal $TESTS; do
  cp "$BUILD/$b" "$PACK.tmp/bin/$b"
  strip --strip-unneeded "$PACK.tmp/bin/$b" 2>/dev/null || true
done

# 3. shared libraries: ldd's closure minus what the GPU machine has (glibc and the
#    loader, the compiler's runtimes, the NVIDIA driver and toolkit)
say "shared libraries"
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libmvec|libpthread|libdl\.so|librt\.so|libutil|libresolv|libstdc\+\+|libgcc_s|libcuda\.so|libcublas|libcublasLt|libcudart|libnvidia|libnccl|libcudnn)'
missing=""
for b in anneal $TESTS; do
  ldd "$BUILD/$b" | while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    if echo "$name" | grep -Eq "$skip"; then continue; fi
    if [ "$path" = "not" ]; then echo "MISSING $name"; continue; fi
    echo "$path"
  done
done | sort -u > "$PACK.tmp/libs.txt"
if grep -q '^MISSING' "$PACK.tmp/libs.txt"; then
  grep '^MISSING' "$PACK.tmp/libs.txt" | grep -v 'libcu\|libnv' >&2 || true
fi
grep -v '^MISSING' "$PACK.tmp/libs.txt" | while read -r p; do cp -L "$p" "$PACK.tmp/lib/"; done
rm -f "$PACK.tmp/libs.txt"
echo "  $(ls "$PACK.tmp/lib" | wc -l) libraries: $(ls "$PACK.tmp/lib" | tr '\n' ' ')"

# 4. the GPT-2 tokenizer and the KJV token shards
say "GPT-2 tokenizer and KJV shards"
cp data/gpt2/encoder.json data/gpt2/vocab.bpe "$PACK.tmp/gpt2/"
command -v bible >/dev/null || { echo "gpu-pack: the bible program is missing (Debian's bible-kjv)" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
bible gen1:1-rev22:21 > "$WORK/kjv.txt"
[ -s "$WORK/kjv.txt" ] || { echo "gpu-pack: bible printed nothing" >&2; exit 1; }
prep_ok=""
for bin in "$BUILD/anneal" build/anneal; do
  [ -x "$bin" ] || continue
  if "$bin" prepare --tokenizer "$PACK.tmp/gpt2" --input "$WORK/kjv.txt" --out "$PACK.tmp/kjv" --val-fraction 0.01 \
       > "$WORK/prepare.log" 2>&1; then
    prep_ok=$bin
    break
  fi
  echo "  ($bin prepare failed: $(tail -1 "$WORK/prepare.log"))"
  rm -rf "$PACK.tmp/kjv"
done
[ -n "$prep_ok" ] || { cat "$WORK/prepare.log" >&2; exit 1; }
tail -2 "$WORK/prepare.log" | sed 's/^/  /'

# 5. the -dev packages of a build there (its pkg-config closure: cJSON, PCRE2,
#    protobuf-c (and protoc-c with its runtime), libmicrohttpd, Cairo/fontconfig and what
#    their .pc files require). The runtime .so files come from lib/ above.
say "Debian -dev packages for a build on the GPU machine"
DEBS="libcjson-dev libpcre2-dev libprotobuf-c-dev protobuf-c-compiler libprotoc32 libprotobuf32 libmicrohttpd-dev
  libcairo2-dev libfontconfig-dev libfreetype-dev libpng-dev zlib1g-dev libbrotli-dev libexpat1-dev libpixman-1-dev
  libx11-dev libxau-dev libxcb1-dev libxcb-render0-dev libxcb-shm0-dev libxdmcp-dev libxext-dev libxrender-dev
  x11proto-dev libglib2.0-dev libffi-dev libgnutls28-dev libidn2-dev libp11-kit-dev libtasn1-6-dev nettle-dev
  pkgconf pkgconf-bin libpkgconf3"
if [ -d "$PACK/debs" ] && [ -n "$(ls "$PACK/debs" 2>/dev/null)" ] && [ -z "${PACK_REFETCH:-}" ]; then
  cp "$PACK"/debs/*.deb "$PACK.tmp/debs/"   # already fetched (PACK_REFETCH=1 fetches again)
else
  (cd "$PACK.tmp/debs" && timeout 300 apt-get download $DEBS > "$WORK/apt.log" 2>&1) \
    || { echo "gpu-pack: apt-get download failed (the build there will not be possible):" >&2; tail -5 "$WORK/apt.log" >&2; }
fi
echo "  $(ls "$PACK.tmp/debs" | wc -l) packages"

# 6. the programs and their libraries as one xz archive each (about 7 MiB against 70:
#    the programs share the library's code), for the call's 64 MiB; gpu-check.sh unpacks
#    them there
say "xz archives of bin/ and lib/"
(cd "$PACK.tmp" && tar cf - bin | xz -9 -T2 > bin.tar.xz && tar cf - lib | xz -9 -T2 > lib.tar.xz && rm -rf bin lib)

# 7. manifest, then swap in
{
  echo "gpu-pack of $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (uncommitted changes)') made $(date -u +%FT%TZ) on $(. /etc/os-release; echo "$PRETTY_NAME")"
  echo "nvcc: $(nvcc --version | tail -2 | head -1)"
  echo "build: $BUILD Release, ANNEAL_CUDA=ON, archs $ARCHS, ANNEAL_MPI=$MPI"
  echo "shards: prepared by $prep_ok with the GPT-2 tokenizer from bible gen1:1-rev22:21"
  (cd "$PACK.tmp" && find . -type f | sort | xargs ls -l | awk '{print $5, $9}')
} > "$PACK.tmp/MANIFEST"
rm -rf "$PACK"
mv "$PACK.tmp" "$PACK"
size=$(du -sm "$PACK" | cut -f1)
say "$PACK: ${size} MiB ($(du -sh "$PACK/bin.tar.xz" | cut -f1) binaries, $(du -sh "$PACK/lib.tar.xz" | cut -f1) libraries, $(du -sh "$PACK/kjv" | cut -f1) shards, $(du -sh "$PACK/debs" | cut -f1) debs)"
[ "$size" -le 40 ] || echo "gpu-pack: warning: $PACK is over 40 MiB" >&2
echo "carry it with: run(command='bash scripts/gpu-check.sh', carry=['.gpu-pack'])"

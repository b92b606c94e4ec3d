#!/usr/bin/env bash
# Installs the Debian packages anneal needs to build and test: the C toolchain,
# CMake, OpenMP (part of gcc), cJSON (safetensors headers), PCRE2, pkg-config, python3 (the
# layer checks in the test suite), Debian's PyTorch with OpenBLAS and python3-venv (the
# base of scripts/pyenv.sh's .venv with transformers, tokenizers and peft), and
# bible-kjv (the King James Bible text `make demo` trains on), OpenMPI (mpirun and
# its headers, for multi-process training; the build works without it), and iproute2
# (`ip netns`: the test that runs two "hosts" over TCP in network namespaces), and for
# src/obs: protobuf-c (TensorBoard event files), libmicrohttpd (the /metrics endpoint),
# Cairo (anneal plot) and prometheus (promtool, which the metrics test runs); clang with
# its sanitizer and libFuzzer runtimes, LLVM's symbolizer and clang's OpenMP (libomp) for
# the fuzz harnesses (`make test-fuzz`).
# As root it runs apt-get; otherwise it prints the command to run.
set -euo pipefail

PACKAGES=(build-essential cmake pkg-config python3 python3-venv python3-pip python3-torch libopenblas0-pthread
          libcjson-dev libpcre2-dev bible-kjv openmpi-bin libopenmpi-dev iproute2
          libprotobuf-c-dev protobuf-c-compiler libmicrohttpd-dev libcairo2-dev prometheus
          clang libclang-rt-dev llvm libomp-dev)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  echo "bootstrap: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "bootstrap: missing packages: ${missing[*]}"
  echo "run: sudo apt-get update && sudo apt-get install -y ${missing[*]}"
  exit 1
fi

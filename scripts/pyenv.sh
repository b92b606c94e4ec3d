#!/usr/bin/env bash
# Creates .venv/ at the repository root: the Python clients the interop tests and the
# fixture generators use (transformers, tokenizers, safetensors, peft), on top of
# Debian's python3-torch (1.13; the venv sees system packages, so nothing pulls PyPI's
# 5 GB CUDA torch: peft and accelerate are installed without their dependencies, the
# ones they need being listed here). Versions are pinned to ones that work with that
# torch and Python 3.11 (tensorboard 2.16.2 with protobuf 4.25.3 for the TensorBoard
# test: they coexist with the transformers pins; onnx 1.17 + onnxruntime 1.20 for the ONNX
# export, openai 1.54 for `anneal serve`, gguf 0.10 + llama-cpp-python for GGUF; numpy and
# protobuf are held at Debian's numpy and the tensorboard pin by a constraints file).
# llama-cpp-python has no wheel on PyPI: it is built from source (llama.cpp, a few
# minutes on 2 cores) in a second step with its own stamp, so a failure there leaves
# the rest usable. Idempotent: stamp files record the pins installed.
# Best effort: without network or Debian's torch it says so and exits 0, and the tests
# that need the clients skip, saying so (under ANNEAL_TEST_STRICT=1 they fail instead).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=/usr/bin/python3
VENV=.venv
PINS="transformers==4.39.3 tokenizers==0.15.2 safetensors==0.4.2 huggingface-hub==0.22.2 jinja2 regex pyyaml tqdm requests filelock packaging psutil tensorboard==2.16.2 protobuf==4.25.3 onnx==1.17.0 onnxruntime==1.20.1 openai==1.54.4 httpx==0.27.2 gguf==0.10.0 sentencepiece"
LLAMA_CPP="llama-cpp-python==0.3.36"
CONSTRAINTS="numpy==$("$PY" -c 'import numpy; print(numpy.__version__)' 2>/dev/null || echo 1.24.2)
protobuf==4.25.3"
IMPORTS="import transformers, tokenizers, peft, torch, tensorboard, onnx, onnxruntime, openai, gguf"
NODEPS="peft==0.10.0 accelerate==0.28.0"
STAMP="$VENV/.anneal-pins"
LLAMA_STAMP="$VENV/.anneal-llama-cpp"
WANT="$PINS | $NODEPS"

# Builds llama-cpp-python (llama.cpp) into the venv unless its stamp says it is there.
install_llama_cpp() {
  if [ -f "$LLAMA_STAMP" ] && [ "$(cat "$LLAMA_STAMP")" = "$LLAMA_CPP" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    return 0
  fi
  echo "pyenv: installing $LLAMA_CPP (built from source, a few minutes, unless pip has the wheel cached)"
  local cfile; cfile=$(mktemp); echo "$CONSTRAINTS" > "$cfile"
  if CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
     "$VENV/bin/pip" install -q --disable-pip-version-check -c "$cfile" "$LLAMA_CPP" \
     && "$VENV/bin/python" -c "import llama_cpp"; then
    echo "$LLAMA_CPP" > "$LLAMA_STAMP"
  else
    echo "pyenv: building $LLAMA_CPP failed; the llama.cpp interop tests will skip"
  fi
  rm -f "$cfile"
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c "$IMPORTS" 2>/dev/null; then
  install_llama_cpp
  exit 0
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "pyenv: Debian's python3-torch is missing (scripts/bootstrap.sh installs it); interop tests will skip"
  exit 0
fi
rm -rf "$VENV"
if ! "$PY" -m venv --system-site-packages "$VENV"; then
  echo "pyenv: cannot create $VENV (python3-venv missing?); interop tests will skip"
  rm -rf "$VENV"; exit 0
fi
CFILE=$(mktemp); echo "$CONSTRAINTS" > "$CFILE"
# shellcheck disable=SC2086
if "$VENV/bin/pip" install -q --disable-pip-version-check -c "$CFILE" $PINS \
   && "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps $NODEPS \
   && "$VENV/bin/python" -c "$IMPORTS"; then
  rm -f "$CFILE"
  echo "$WANT" > "$STAMP"
  echo "pyenv: $VENV ready ($("$VENV/bin/python" -c 'import transformers, tokenizers, peft, torch; print("transformers", transformers.__version__, "tokenizers", tokenizers.__version__, "peft", peft.__version__, "torch", torch.__version__)'))"
else
  rm -f "$CFILE"
  echo "pyenv: installing the Python clients failed (no network?); interop tests will skip"
  rm -rf "$VENV"
  exit 0
fi
install_llama_cpp
exit 0

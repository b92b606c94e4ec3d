#!/usr/bin/env bash
# Creates .venv/ at the repository root: the Python clients the interop tests and the
# fixture generators use (transformers, tokenizers, safetensors, peft), on top of
# Debian's python3-torch (1.13; the venv sees system packages, so nothing pulls PyPI's
# 5 GB CUDA torch: peft and accelerate are installed without their dependencies, the
# ones they need being listed here). Versions are pinned to ones that work with that
# torch and Python 3.11 (tensorboard 2.16.2 with protobuf 4.25.3 for the TensorBoard
# test: they coexist with the transformers pins). Idempotent: a stamp file records the pins installed.
# Best effort: without network or Debian's torch it says so and exits 0, and the tests
# that need the clients skip, saying so (under ANNEAL_TEST_STRICT=1 they fail instead).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=/usr/bin/python3
VENV=.venv
PINS="transformers==4.39.3 tokenizers==0.15.2 safetensors==0.4.2 huggingface-hub==0.22.2 jinja2 regex pyyaml tqdm requests filelock packaging psutil tensorboard==2.16.2 protobuf==4.25.3"
NODEPS="peft==0.10.0 accelerate==0.28.0"
STAMP="$VENV/.anneal-pins"
WANT="$PINS | $NODEPS"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c "import transformers, tokenizers, peft, torch, tensorboard" 2>/dev/null; then
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
# shellcheck disable=SC2086
if "$VENV/bin/pip" install -q --disable-pip-version-check $PINS \
   && "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps $NODEPS \
   && "$VENV/bin/python" -c "import transformers, tokenizers, peft, torch, tensorboard"; then
  echo "$WANT" > "$STAMP"
  echo "pyenv: $VENV ready ($("$VENV/bin/python" -c 'import transformers, tokenizers, peft, torch; print("transformers", transformers.__version__, "tokenizers", tokenizers.__version__, "peft", peft.__version__, "torch", torch.__version__)'))"
else
  echo "pyenv: installing the Python clients failed (no network?); interop tests will skip"
  rm -rf "$VENV"
fi
exit 0

#!/usr/bin/env bash
# The test venv .venv-sglang: sglang==0.5.23 with only what its disaggregation package imports, so
# the SGLang tests (tests/kv_transfer/test_sglang_*.py) can run SGLang's own decode-side transfer
# classes on CPU. Idempotent. About 6 GB, nearly all of it torch: SGLang's import chain reaches
# torchvision (through its model configs), and PyPI's torchvision loads only beside a CUDA torch,
# so this venv holds SGLang's own pin, torch 2.14.1 (CUDA build; it runs on CPU) -- not the CPU
# torch of .venv. NIXL then detects CUDA 13, hence nixl-cu13.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${SGLANG_VENV:-.venv-sglang}

step() { echo "[setup-sglang $(date +%H:%M:%S)] $*"; }

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import sglang.srt.disaggregation.nixl.conn" 2>/dev/null; then
  step "$VENV already imports sglang 0.5.23's NIXL backend"
  exit 0
fi
step "creating $VENV ($("$PY" --version))"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -v -e "is ignored" -e "requires" -e "dependency resolver" || true; }
pip --upgrade pip
step "torch 2.14.1 + torchvision 0.29.1 (SGLang's pin; the longest step)"
pip "torch==2.14.1" "torchvision==0.29.1"
step "sglang 0.5.23 without its dependencies, then those its disaggregation imports"
pip --no-deps "sglang==0.5.23"
pip "transformers==5.19.0" "apache-tvm-ffi==0.1.11" numpy msgspec pyzmq requests aiohttp orjson psutil \
    pybase64 packaging pillow tqdm pydantic dill triton starlette ipython sentencepiece compressed-tensors gguf
step "NIXL 1.5.1 (the cu13 build: this torch is CUDA 13)"
pip "nixl-cu13==1.5.1"
pip --no-deps "nixl==1.5.1"
"$VENV/bin/python" -c "import torch, sglang.srt.disaggregation.nixl.conn, nixl._api; print('sglang venv ok, torch', torch.__version__)" 2>&1 | tail -1
step "done: $VENV"

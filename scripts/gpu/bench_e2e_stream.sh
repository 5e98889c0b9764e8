#!/usr/bin/env bash
# One device call for `prefill-server bench e2e stream` (sparse mode, each layer's KV streamed over
# NIXL to a receiver process), from the repo root on the GPU machine:
#   scripts/gpu/bench_e2e_stream.sh [bench args]        (call with carry: [".whl"])
# Writes $OUT/stream.json, stream.log and smi.csv (SM clock, power, memory of both processes).
# The GPU image has no NIXL, msgspec or pyzmq: they travel as cp312 wheels in .whl/ (ignored by git):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl nixl-cu13==1.5.1 nixl==1.5.1 msgspec==0.23.0 pyzmq==27.3.0
# nixl-cu13's wheel (59 MB) is over what a call carries with the rest: repack it without nixl_ep_cu13/
# (the expert-parallel torch extensions), nixl_cu13.scripts/ and UCX's perftest library (and their
# RECORD lines): 28 MB. nixl's meta package then picks nixl_cu13 by itself (torch is cu130 there).
# With nixl-cu12 instead, VRAM registration fails ("VRAM memory is detected as host by UCX", runs 1-2)
# unless UCX_MEMTYPE_CACHE=n (issue 6 third slice, scripts/gpu/e2e_stream_nixl.sh probes); set here.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-.devout}
mkdir -p "$out" && out=$(cd "$out" && pwd)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export UCX_MEMTYPE_CACHE=${UCX_MEMTYPE_CACHE:-n}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
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
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,memory.used,clocks_event_reasons.active \
  --format=csv,noheader -lms 200 > "$out/smi.csv" 2>&1 &
smi=$!
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${E2E_TIMEOUT:-280}" python3 -m prefill_server.bench.stream \
  --out "$out/stream.json" "$@" 2>&1 | tee "$out/stream.log" | grep -v -e "NIXL INFO" -e "^\[receiver\]"
echo "rc=$?"
kill "$smi" 2>/dev/null

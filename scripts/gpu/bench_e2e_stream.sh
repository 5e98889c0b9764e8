#!/usr/bin/env bash
# One device call for `prefill-server bench e2e stream` (sparse mode, each layer's KV streamed over
# NIXL to a receiver process), from the repo root on the GPU machine:
#   scripts/gpu/bench_e2e_stream.sh [bench args]        (call with carry: [".whl"])
# Writes $OUT/stream.json, stream.log and smi.csv (SM clock, power, memory of both processes).
# The GPU image has no NIXL, msgspec or pyzmq: they travel as cp312 wheels in .whl/ (ignored by git):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl nixl-cu12==1.5.1 nixl==1.5.1 msgspec==0.23.0 pyzmq==27.3.0
# nixl-cu12's wheel (69 MB) is over the 64 MiB carry limit: repack it without nixl_ep_cu12/ (the
# expert-parallel torch extensions, 108 MB unpacked), nixl_cu12.scripts/ and UCX's perftest
# library (and their RECORD lines): 27 MB.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-.devout}
mkdir -p "$out" && out=$(cd "$out" && pwd)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  # nixl's meta package imports nixl_cu<torch's CUDA major>, 13 there; only the cu12 build travels
  # (its UCX needs nothing of CUDA but the driver's libcuda), so it is told to take that one.
  sed -i 's/^def detect_cuda_major() -> int | None:$/&\n    return 12  # bench_e2e_stream.sh: only nixl-cu12 is here/' \
    /tmp/site/nixl_meta_utils.py
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  # UCX does not find the CUDA transports the wheel bundles by itself: VRAM registration fails with
  # "VRAM memory is detected as host by UCX" (run 1; known: ai-dynamo/nixl issue 1628). Point it there.
  export UCX_MODULE_DIR=${UCX_MODULE_DIR:-/tmp/site/nixl_cu12.libs/ucx}
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv,noheader
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

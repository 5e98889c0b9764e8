#!/usr/bin/env bash
# Device call 5 (after call 4, on the same card): the whole GPU smoke test, every bar of issue 20 with
# its baseline in the same run; the 128K streamed bar and the kernel case now run the warp-specialised
# kernel on sm_90. Carry [".whl"] (the NIXL wheels for the streamed bars).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_wheels
gpu_info | tee "$out/info.txt"
timeout 560 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/bench/test_gpu_bench_smoke.py 2>&1 \
  | tee "$out/smoke.log" | grep -E "passed|failed|Error|assert" | tail -8

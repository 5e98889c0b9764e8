#!/usr/bin/env bash
# Device call 3: the GPU smoke test's attention case with the warp-specialised kernel as the default
# (128K at fixed 1% and 5% masks, cuDNN and FlexAttention at its best settings in the same run).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 300 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/bench/test_gpu_bench_smoke.py \
  -k attention_bench_128k 2>&1 | tee "$out/smoke.log" | grep -E "128K|passed|failed|Error|assert" | tail -8

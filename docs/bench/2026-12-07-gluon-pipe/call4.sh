#!/usr/bin/env bash
# Device call 4 (for the H200, the issue's card): `bench attention` at 128K 1 / 2 / 5% with cuDNN dense
# and FlexAttention at its best settings in the same run; the default launch is the warp-specialised
# kernel on sm_90.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 200 python3 -m prefill_server.bench.attention --lengths 131072 --densities 0.01,0.02,0.05 \
  --budget-ms 600 --out "$out/attention.json" 2>&1 | tee "$out/attention.log" | grep -E "ours_|dense_cudnn|^ +131072 +flex "

#!/usr/bin/env bash
# Device call 4 (for the H200, the issue's card): `bench attention` at 128K 1 / 5% with cuDNN dense
# and FlexAttention at its best settings in the same run; the default launch is the warp-specialised
# kernel on sm_90. Its GPU tests first (with q / k / v as views of one projection buffer). Then what its
# fixed reference costs when it falls back (docs/bench/2026-12-08-ws-fallback/bench.py, into $out/fallback).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 80 python3 -m pytest -q -m gpu tests/kernels/test_block_sparse_triton.py -p no:cacheprovider \
  -k "warp_specialised and (views or redoes or 8192)" 2>&1 | tee "$out/kernel_tests.log" | tail -3
timeout 110 python3 -m prefill_server.bench.attention --lengths 131072 --densities 0.01,0.05 \
  --budget-ms 400 --out "$out/attention.json" 2>&1 | tee "$out/attention.log" | grep -E "ours_|dense_cudnn|^ +131072 +flex "
timeout 170 python3 docs/bench/2026-12-08-ws-fallback/bench.py --out "$out/fallback" 2>&1 \
  | tee "$out/fallback.log" | grep -E "^131072|all checks|Error|error" | cut -c1-260

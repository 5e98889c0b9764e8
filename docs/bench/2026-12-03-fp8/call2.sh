#!/usr/bin/env bash
# Device call 2 (issue 20, FP8): the GPU tests (IEEE divisions in the quantization pass), the GEMM
# microbench with use_fast_accum's error, 64 x 8K in FP8 with fast accumulation, and the 128K / 1M
# streamed runs in FP8 (call with carry: [".whl"]).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/layers/test_fp8.py 2>&1 | tail -3 | tee "$out/tests.txt"
timeout 120 python3 docs/bench/2026-12-03-fp8/gemm.py --rows 65536 --out "$out/gemm.json" 2>&1 | tail -6
timeout 150 python3 -m prefill_server.bench.e2e --lengths 8192 --reps 3 --throughput 64x8192 --token-budget 65536 \
  --quantization fp8 --fp8-fast-accum --out "$out/e2e_fp8_fast.json" 2>&1 | tail -2
OUT=$out TIMEOUT=280 scripts/gpu/stream.sh --lengths 131072 --densities 0.02 --variants nixl --estimator-lengths "" \
  --long 1048576 --long-runs nixl:1 --reps 2 --quantization fp8 2>&1 | tail -25

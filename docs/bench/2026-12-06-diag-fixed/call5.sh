#!/usr/bin/env bash
# Device call 5 (issue 20, 1M at a fixed 2% mask within 25 s): the shipped kernel (fixm 2 for sparse
# masks) after the GPU kernel tests, 1M tokens with FP8 linear layers (32K-row chunks) and FP8 scores
# (--fp8-attention on, bf16 pages), all KV streamed to a receiver process over NIXL: the run of
# docs/bench/2026-12-06-fp8-attention/call4.sh's "on" half (24.53 s there with fixm 1). Carry [".whl"].
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_block_sparse_triton.py -p no:cacheprovider \
  -k "full_size or fixed_reference or fp8_scores" > "$out/tests.txt" 2>&1
rc=$?; tail -3 "$out/tests.txt"
[ $rc = 0 ] || exit $rc
mkdir -p "$out/fp8_on"
OUT=$out/fp8_on TIMEOUT=170 scripts/gpu/stream.sh --lengths "" --estimator-lengths "" --long 1048576 \
  --long-runs nixl:1 --quantization fp8 --chunk-tokens 32768 --fp8-attention on 2>&1 \
  | grep -E "^ +nixl +1048576 |check:|rc=|Error|error"
rm -f "$out/fp8_on/smi.csv"

#!/usr/bin/env bash
# Device call (issue 20): FP8 scores in our attention kernel against cuDNN bf16 and our bf16 kernel,
# after the kernel's GPU tests (the fp8 one included). About 3 minutes; no wheels.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_block_sparse_triton.py -p no:cacheprovider > "$out/tests.txt" 2>&1
rc=$?; tail -5 "$out/tests.txt"
[ $rc = 0 ] || exit $rc
timeout 300 python3 docs/bench/2026-12-06-fp8-attention/scores.py --out "$out/scores.json" 2>&1 | tail -6

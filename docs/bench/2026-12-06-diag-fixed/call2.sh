#!/usr/bin/env bash
# Device call 2 (issue 20): the GPU kernel tests with fixm 2 the default for sparse masks, then
# `prefill-server bench attention` (scripts/gpu/attention.sh) at 128K and 256K, 1 / 2 / 5 / 10%, with
# FlexAttention tuned over its configurations at each length (the fastest correct one compared).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_block_sparse_triton.py -p no:cacheprovider \
  -k "full_size or fixed_reference" > "$out/tests.txt" 2>&1
rc=$?; tail -3 "$out/tests.txt"
[ $rc = 0 ] || exit $rc
OUT=$out KERNEL_TESTS=0 LONG=0 TIMEOUT=470 scripts/gpu/attention.sh --lengths 131072,262144 \
  --densities 0.01,0.02,0.05,0.1 2>&1 | grep -v "^ *$" | tail -40

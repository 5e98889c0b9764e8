#!/usr/bin/env bash
# Device call 6 (issue 20, kernel at 128K 1%): whole items' output stored by one TMA store (ostore 2;
# offline ~120 fewer instructions per item) against the shipped kernel, 128K and 256K at 1 / 2 / 5%,
# three interleaved rounds, after the GPU kernel tests of the variant. About 3 minutes. The variant's
# code is in commit 07e1f14 (dropped after this call: slower).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_block_sparse_triton.py -p no:cacheprovider \
  -k "fixed_reference_variants" > "$out/tests.txt" 2>&1
rc=$?; tail -3 "$out/tests.txt"
[ $rc = 0 ] || exit $rc
timeout 300 python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --out "$out/tune.json" --best "$out/best.txt" \
  --tokens 131072,262144 --densities 0.01,0.02,0.05 --rounds 3 --no-flex --variants 1 \
  --extra grid,4,32,64,8,2,128,2,1,2,1,2,0 --extra grid,4,32,64,8,2,128,2,1,2,1,2,2 2>&1 | tail -9

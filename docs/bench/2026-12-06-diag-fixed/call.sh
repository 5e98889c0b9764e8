#!/usr/bin/env bash
# Device call (issue 20, kernel at 128K 1% within 1.2x ideal): fixm 2 (one row max from the diagonal
# tile holding the item's first query, every other tile against it held fixed) against the shipped
# fixm 1, at 128K and 256K, 1 / 2 / 5%, three interleaved rounds, cuDNN dense in the same run; the
# GPU kernel tests first (fixm 2 with each K/V load scheme compiled for sm_90). About 4 minutes.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_block_sparse_triton.py -p no:cacheprovider \
  -k "fixed_reference or fp8_scores or full_size" > "$out/tests.txt" 2>&1
rc=$?; tail -3 "$out/tests.txt"
[ $rc = 0 ] || exit $rc
timeout 330 python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --out "$out/tune.json" --best "$out/best.txt" \
  --tokens 131072,262144 --densities 0.01,0.02,0.05 --rounds 3 --no-flex --variants 1 \
  --extra grid,4,32,64,8,2,128,2,1,2,1,2 2>&1 | tail -8

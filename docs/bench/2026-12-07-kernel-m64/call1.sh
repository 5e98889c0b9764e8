#!/usr/bin/env bash
# Device call 1: items of 16 tokens x 4 heads (M = 64 rows, 4 warps) so that four programs fit on an
# SM (128 registers x 128 threads; 49-66 KB of shared memory) where the shipped launch fits two of
# 128 rows: the same rows resident, in programs half as long, whose fixed phases (Q load, pipeline
# fill, store) the others can cover. Beside the shipped launch, 128K at 1 / 2 / 5%, correctness first.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
V=grid,4
timeout 480 python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --out "$out/tune.json" --best "$out/best.txt" \
  --tokens 131072 --finalists 0 --no-flex --rounds 3 --densities 0.01,0.02,0.05 --variants 0 \
  --extra $V,32,64,8,2,128,2,1,2,1,2 --extra $V,16,32,4,2,128,4,1,2,1,2 --extra $V,16,32,4,3,128,4,1,2,1,2 \
  --extra $V,16,64,4,1,128,4,1,2,1,2 --extra $V,16,64,4,2,128,2,1,2,1,2 2>&1 | tail -40
echo "rc=$?"

#!/usr/bin/env bash
# Device call (issue 20, kernel at 128K 1% within 1.2x ideal; now 1.35x): the shipped launch against
# tilings that change the number of programs or how many share an SM, at 1 / 2 / 5% (128K, three
# interleaved rounds; the two best and the baseline again at 256K), cuDNN dense in the same run.
# Variant keys: mode, gp, tok, bn, num_warps, num_stages, maxnreg, ctas_per_sm, fma, kvload, rcp, fixm.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 560 python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --out "$out/tune.json" --best "$out/best.txt" \
  --tokens 131072,262144 --densities 0.01,0.02,0.05 --rounds 3 --no-flex --variants 1 \
  --extra grid,4,64,64,16,2,128,1,1,2,1,1 \
  --extra grid,4,16,64,4,2,128,2,1,2,1,1 \
  --extra grid,4,16,32,4,2,128,4,1,2,1,1 \
  --extra grid,4,32,64,8,3,128,1,1,2,1,1 2>&1 | tail -12

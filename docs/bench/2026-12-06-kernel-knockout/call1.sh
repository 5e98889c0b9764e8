#!/usr/bin/env bash
# Device call 1 (not run yet): the shipped kernel with parts knocked out, two items per program (KO 64)
# and the peeled reference tile (KO 16),
# 128K at 1 / 2 / 5% (knockout.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 400 python3 docs/bench/2026-12-06-kernel-knockout/knockout.py --out "$out/ko.json" \
  --densities 0.01,0.02,0.05 --kos 0,64,16,1,2,4,8,3,7 2>&1 | tail -40
echo "rc=$?"

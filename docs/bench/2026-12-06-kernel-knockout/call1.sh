#!/usr/bin/env bash
# Device call 1: the shipped kernel with parts knocked out, and the peeled reference tile (KO bit 16),
# 128K at 1 / 2 / 5% (knockout.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 400 python3 docs/bench/2026-12-06-kernel-knockout/knockout.py --out "$out/ko.json" \
  --densities 0.01,0.02,0.05 --kos 0,16,48,1,2,4,8,3,7 2>&1 | tail -40
echo "rc=$?"

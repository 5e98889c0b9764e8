#!/usr/bin/env bash
# Device call 2 (trimmed to the device time left): 128K at 1% only, two rounds (knockout.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 150 python3 docs/bench/2026-12-06-kernel-knockout/knockout.py --out "$out/ko.json" \
  --densities 0.01 --kos 0,16,48,1,2,4,3,7 --rounds 2 --budget-ms 250 2>&1 | tail -30
echo "rc=$?"

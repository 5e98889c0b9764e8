#!/usr/bin/env bash
# Device call 5: KO 256, the program without its check-and-redo (the CTA-wide sum of failing rows and
# the online redo's code behind it; a flag per failing row instead), beside the faithful copy (KO 0)
# and the shipped launch, 128K at 1 / 2 / 5%. Offline (sm_90): 1,896 SASS instructions vs 3,320, the
# listed-tile loop 248-249 instructions vs 263-268, but spills in two unrolled loops.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 400 python3 docs/bench/2026-12-06-kernel-knockout/knockout.py --out "$out/ko.json" \
  --densities 0.01,0.02,0.05 --kos 0,256 --rounds 3 2>&1 | tail -40
echo "rc=$?"

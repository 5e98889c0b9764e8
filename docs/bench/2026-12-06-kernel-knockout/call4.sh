#!/usr/bin/env bash
# Device call 4: how much of the bench's timed span at 128K 1% is the kernel's GPU time (timing.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 400 python3 docs/bench/2026-12-06-kernel-knockout/timing.py --out "$out/timing.json" 2>&1 | tail -60
echo "rc=$?"

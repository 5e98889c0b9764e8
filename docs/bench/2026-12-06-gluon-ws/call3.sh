#!/usr/bin/env bash
# Device call 3 (hung: the default group's 256 registers past the pool with compute_regs 232; rerun as call 4 with 216): two compute partitions, the first diagonal tile peeled (no zeroed accumulator), diagonal tiles of 128 / 64 / 32 keys, the next item's scalars prefetched; correctness (against the float32
# reference) then 128K at 1 / 2 / 5% and all blocks beside the shipped kernel and cuDNN dense.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
B=docs/bench/2026-12-06-gluon-ws/bench.py
timeout 150 python3 $B check --out "$out/check.json" 2>&1 | tail -20
rc=$?; echo "check rc=$rc"
timeout 300 python3 $B time --out "$out/time.json" --tokens 131072 --densities 0.01,0.02,0.05 --dense 2>&1 | tail -40
echo "time rc=$?"

#!/usr/bin/env bash
# Device call 4 (hung as call 3: the compiler kept the first item's tile counts for every item; call 5): two compute partitions, the first diagonal tile peeled (no zeroed accumulator), diagonal tiles of 128 / 64 / 32 keys, the next item's scalars prefetched; correctness (against the float32
# reference) then 128K at 1 / 2 / 5% and all blocks beside the shipped kernel and cuDNN dense.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
B=docs/bench/2026-12-06-gluon-ws/bench.py
timeout 100 python3 $B check --out "$out/check.json" 2>&1 | tail -20
rc=$?; echo "check rc=$rc"
[ $rc = 0 ] || exit $rc
timeout 260 python3 $B time --out "$out/time.json" --tokens 131072 --densities 0.01,0.02,0.05 --dense 2>&1 | tail -40
echo "time rc=$?"

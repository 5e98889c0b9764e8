#!/usr/bin/env bash
# Device call 5 (after calls 3-4: each item's tile counts are now read at the top of its iteration, not carried from the previous one: the compiler had kept the first item's counts for all, a hang): two compute partitions, the first diagonal tile peeled, diagonal tiles of 128 / 64 / 32 keys; correctness (against the float32
# reference) then 128K at 1 / 2% beside the shipped kernel and cuDNN dense (trimmed to the device time left).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
B=docs/bench/2026-12-06-gluon-ws/bench.py
V="nwg=2,bn=128,stages=2,fixed=1,bd=128;nwg=2,bn=128,stages=2,fixed=1,bd=64;nwg=2,bn=128,stages=2,fixed=1,bd=32"
timeout 70 python3 $B check --out "$out/check.json" --variants "$V" 2>&1 | tail -20
rc=$?; echo "check rc=$rc"
[ $rc = 0 ] || exit $rc
timeout 150 python3 $B time --out "$out/time.json" --tokens 131072 --densities 0.01,0.02 --variants "$V" 2>&1 | tail -40
echo "time rc=$?"

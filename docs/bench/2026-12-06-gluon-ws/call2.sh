#!/usr/bin/env bash
# Device call 2: two compute partitions (each 64 rows of an item, K/V tiles shared), correctness (against the float32
# reference) then 128K at 1 / 2 / 5% and all blocks beside the shipped kernel and cuDNN dense.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
B=docs/bench/2026-12-06-gluon-ws/bench.py
V="bn=128,stages=2,fixed=1,nwg=1,peel=0;bn=128,stages=2,fixed=1,nwg=2,peel=0;bn=64,stages=4,fixed=1,nwg=2,peel=0;bn=128,stages=2,fixed=0,nwg=2,peel=0"
timeout 150 python3 $B check --out "$out/check.json" --variants "$V" 2>&1 | tail -20
rc=$?; echo "check rc=$rc"
timeout 300 python3 $B time --out "$out/time.json" --variants "$V" --tokens 131072 --densities 0.01,0.02,0.05 --dense 2>&1 | tail -40
echo "time rc=$?"

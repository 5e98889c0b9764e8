#!/usr/bin/env bash
# Device call 6: is the loss in call 5 the peeled first tile? The same card kind, peel on and off at
# diagonal tiles of 128 keys (peel off = call 2's kernel but for the check per row), 128K 1 / 2%.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
B=docs/bench/2026-12-06-gluon-ws/bench.py
V="nwg=2,bn=128,stages=2,fixed=1,bd=128,peel=0;nwg=2,bn=128,stages=2,fixed=1,bd=128;nwg=2,bn=128,stages=2,fixed=1,bd=64"
VC="nwg=2,bn=128,stages=2,fixed=1,bd=128,peel=0"
timeout 70 python3 $B check --out "$out/check.json" --variants "$VC" 2>&1 | tail -20
rc=$?; echo "check rc=$rc"
[ $rc = 0 ] || exit $rc
timeout 150 python3 $B time --out "$out/time.json" --tokens 131072 --densities 0.01,0.02 --variants "$V" 2>&1 | tail -40
echo "time rc=$?"

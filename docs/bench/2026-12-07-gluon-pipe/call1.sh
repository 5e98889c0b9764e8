#!/usr/bin/env bash
# Device call 1: the Gluon kernel's listed tiles software-pipelined inside each warpgroup (pipe=1:
# tile u's Q K^T with tile u-1's P V on the tensor cores, the exponentials beside P V), K and V
# stages released apart; tstore=1: the output by TMA through the item's Q buffer; pp=1: the two
# compute partitions take turns on the tensor cores (run last: a wrong turn count would hang).
# Against the same kernel without them and the shipped Triton kernel, 128K 1 / 2%.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
B=docs/bench/2026-12-06-gluon-ws/bench.py
BASE="nwg=2,bn=128,stages=2,fixed=1,bd=64"
B64="nwg=2,bn=64,stages=4,fixed=1,bd=64"
VC="$BASE,pipe=1;$BASE,pipe=1,tstore=1;$B64,pipe=1,tstore=1"
V="$BASE;$BASE,tstore=1;$BASE,pipe=1;$BASE,pipe=1,tstore=1;$B64,pipe=1,tstore=1"
timeout 90 python3 $B check --out "$out/check.json" --variants "$VC" 2>&1 | tail -20
rc=$?; echo "check rc=$rc"
[ $rc = 0 ] || exit $rc
timeout 200 python3 $B time --out "$out/time.json" --tokens 131072 --densities 0.01,0.02 --variants "$V" 2>&1 | tail -40
echo "time rc=$?"
VP="$BASE,pipe=1,tstore=1,pp=1"
timeout 60 python3 $B check --out "$out/check_pp.json" --variants "$VP" 2>&1 | tail -8
rc=$?; echo "check pp rc=$rc"
[ $rc = 0 ] || exit $rc
timeout 120 python3 $B time --out "$out/time_pp.json" --tokens 131072 --densities 0.01,0.02 \
  --variants "$BASE,pipe=1,tstore=1;$VP" 2>&1 | tail -20
echo "time pp rc=$?"

#!/usr/bin/env bash
# Device call (issue 20): the new GPU smoke test of the long-prompt bars (FP8, fixed 2% mask, every
# layer's KV streamed over NIXL to a receiver process: 128K <= 2.5 s, 1M <= 25 s), then the kernel
# at 128K 1 / 2% against cuDNN in the same process (ATTN=0: the smoke test only). Carry [".whl"].
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_wheels || exit 1
gpu_info | tee "$out/info.txt"
timeout 420 python3 -m pytest -q -m gpu -s -p no:cacheprovider --basetemp=/tmp/pt \
  tests/bench/test_gpu_bench_smoke.py -k streamed 2>&1 | grep -v "NIXL INFO" | tee "$out/smoke.log" \
  | grep -E "^ +(none|nixl) |FP8, 2%|passed|failed|Error" | tail -12
for f in 128k 1m; do find /tmp/pt -name "$f.json" -exec cp {} "$out/stream_$f.json" \; ; done
[ "${ATTN:-1}" = 0 ] && exit 0
mkdir -p "$out/attn"
OUT=$out/attn KERNEL_TESTS=0 LONG=0 TIMEOUT=100 scripts/gpu/attention.sh --lengths 131072 \
  --densities 0.01,0.02 --skip-flex 2>&1 | tail -8
rm -f "$out/attn/smi.csv"

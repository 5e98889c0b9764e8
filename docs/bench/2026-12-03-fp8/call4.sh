#!/usr/bin/env bash
# Device call 4 (issue 20): 1M tokens at a fixed 2% mask, KV streamed to a receiver process: bf16
# (the baseline) and FP8 with 32K-row chunks in the same call (call with carry: [".whl"]).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
for run in "none 0" "fp8 32768"; do
  set -- $run
  mkdir -p "$out/$1_$2"
  OUT=$out/$1_$2 TIMEOUT=150 scripts/gpu/stream.sh --lengths "" --estimator-lengths "" \
    --long 1048576 --long-runs nixl:1 --quantization $1 --chunk-tokens $2 2>&1 | grep -E "^ +nixl +1048576 |check:|rc="
done

#!/usr/bin/env bash
# Device call (issue 20, 1M at a fixed 2% mask within 25 s): FP8 linear layers (32K-row chunks) with
# bf16 scores, then with FP8 scores (--fp8-attention on; the pages stay bf16), 1M tokens, KV streamed
# to a receiver process over NIXL, in one call after the FP8-scores GPU tests (call with carry:
# [".whl"], the wheels of scripts/gpu/lib.sh). About 7 minutes.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_paged_attention_fp8.py tests/layers/test_fp8.py \
  -p no:cacheprovider > "$out/tests.txt" 2>&1
rc=$?; tail -3 "$out/tests.txt"
[ $rc = 0 ] || exit $rc
for a in off on; do
  mkdir -p "$out/fp8_$a"
  OUT=$out/fp8_$a TIMEOUT=170 scripts/gpu/stream.sh --lengths "" --estimator-lengths "" --long 1048576 \
    --long-runs nixl:1 --quantization fp8 --chunk-tokens 32768 --fp8-attention $a 2>&1 \
    | grep -E "^ +nixl +1048576 |check:|rc=|Error|error"
  rm -f "$out/fp8_$a/smi.csv"
done

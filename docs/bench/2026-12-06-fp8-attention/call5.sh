#!/usr/bin/env bash
# Device call (issue 20): FP8 scores for later chunks (a prompt longer than --token-budget): the GPU
# tests, then 8 prompts of 32K through 8K-token steps (every step after a prompt's first reads its
# earlier keys back from FP8 pages), FP8 linear + FP8 pages, bf16 scores against FP8 scores, one call.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_paged_attention_fp8.py tests/layers/test_fp8.py \
  tests/engine/test_kv_format_engine.py -p no:cacheprovider > "$out/tests.txt" 2>&1
rc=$?; tail -3 "$out/tests.txt"
[ $rc = 0 ] || exit $rc
for a in off auto; do
  timeout 150 python3 -m prefill_server.bench.e2e --lengths 8192 --reps 1 --throughput 8x32768 --token-budget 8192 \
    --skip-floor --check-len 0 --quantization fp8 --kv-cache-dtype fp8 --fp8-attention $a \
    --out "$out/chunked_$a.json" 2>&1 | grep -i "throughput 8x\|error" | tail -2
done

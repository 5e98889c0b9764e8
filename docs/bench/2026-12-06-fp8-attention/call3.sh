#!/usr/bin/env bash
# Device call (issue 20): one long prompt's TTFT with FP8 linear + FP8 pages, bf16 scores against
# FP8 scores (--fp8-attention auto, the default), dense, at 32K and 128K. About 4 minutes.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
for a in off auto; do
  timeout 240 python3 -m prefill_server.bench.e2e --lengths 32768,131072 --reps 2 --long-reps 2 --throughput "" \
    --skip-floor --check-len 0 --quantization fp8 --kv-cache-dtype fp8 --fp8-attention $a --out "$out/ttft_$a.json" 2>&1 \
    | grep -i "ttft\|error" | tail -4
done

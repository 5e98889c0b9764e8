#!/usr/bin/env bash
# Device call 1 (issue 20, FP8 KV pages): the CUDA pool's FP8 pages against the CPU pool's (whose
# bytes are tested against vLLM's code), then bench e2e with FP8 projections and bf16 vs FP8 pages
# in the same call (TTFT 8K / 32K / 128K, 64 x 8K): what quantizing on write costs.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_kv_format_engine.py 2>&1 | tail -20 > "$out/tests.txt"
tail -3 "$out/tests.txt"
gpu_smi_start "$out/smi.csv" 200
for kv in auto fp8 auto fp8; do
  n=$(ls "$out" | grep -c "^e2e_$kv")
  timeout 200 python3 -m prefill_server.bench.e2e --lengths 8192,32768,131072 --reps 3 --throughput 64x8192 \
    --token-budget 65536 --skip-floor --check-len 0 --quantization fp8 --kv-cache-dtype $kv \
    --out "$out/e2e_${kv}_$n.json" 2>&1 | tail -4
done
gpu_smi_stop

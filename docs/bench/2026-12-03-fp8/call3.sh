#!/usr/bin/env bash
# Device call 3 (issue 20, FP8 with the norms and SiLU-and-multiply writing FP8 codes, fast
# accumulation): the GPU tests; bench e2e in bf16 and in FP8 in the same call (TTFT 8K / 32K / 128K,
# 64 x 8K); the 128K / 1M streamed runs in FP8 (call with carry: [".whl"]).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/layers/test_fp8.py 2>&1 | tail -30 > "$out/tests.txt"
tail -3 "$out/tests.txt"
gpu_smi_start "$out/smi.csv" 200
for q in none fp8; do
  timeout 200 python3 -m prefill_server.bench.e2e --lengths 8192,32768,131072 --reps 3 --throughput 64x8192 \
    --token-budget 65536 --skip-floor --check-len 0 --quantization $q --out "$out/e2e_$q.json" 2>&1 | tail -5
done
gpu_smi_stop
OUT=$out TIMEOUT=200 scripts/gpu/stream.sh --lengths 131072 --densities 0.02 --variants nixl --estimator-lengths "" \
  --long 1048576 --long-runs nixl:1 --reps 2 --quantization fp8 2>&1 | tail -6

#!/usr/bin/env bash
# Device call (issue 20) for an H200, the judge's card, which earlier sessions could not get for these
# bars (measured on an H100): 1M at a fixed 2% mask with FP8 linear and FP8 scores streamed to a
# receiver process over NIXL; FP8 64 x 8K throughput vs bf16 (the engine's default FP8 path:
# --quantization fp8 --kv-cache-dtype fp8, FP8 scores); then the kernel at 128K 1 / 2%. Each part
# writes its own files, so a call cut short keeps what finished. Carry [".whl"].
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
mkdir -p "$out/fp8_on"
OUT=$out/fp8_on TIMEOUT=400 scripts/gpu/stream.sh --lengths "" --estimator-lengths "" --long 1048576 \
  --long-runs nixl:1 --quantization fp8 --chunk-tokens 32768 --fp8-attention on 2>&1 \
  | grep -E "^ +nixl +1048576 |check:|rc=|Error|error"
rm -f "$out/fp8_on/smi.csv"
ARGS="--lengths 8192 --reps 1 --throughput 64x8192 --token-budget 65536 --skip-floor --check-len 0"
for name in none fp8_kv8_qk8; do
  flags=(--quantization none)
  [ $name = fp8_kv8_qk8 ] && flags=(--quantization fp8 --kv-cache-dtype fp8)
  timeout 150 python3 -m prefill_server.bench.e2e $ARGS "${flags[@]}" --out "$out/e2e_$name.json" 2>&1 \
    | grep -i "throughput 64\|error" | tail -3
done
mkdir -p "$out/attn"
OUT=$out/attn KERNEL_TESTS=0 LONG=0 TIMEOUT=100 scripts/gpu/attention.sh --lengths 131072 \
  --densities 0.01,0.02 --skip-flex 2>&1 | tail -8
rm -f "$out/attn/smi.csv"

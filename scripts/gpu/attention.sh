#!/usr/bin/env bash
# GPU entry: `prefill-server bench attention` (cuDNN dense vs FlexAttention vs our block-sparse
# kernel and its estimator, Llama-3.1-8B attention shape, bf16), from the repo root on the GPU machine:
#   scripts/gpu/attention.sh [bench attention args]
# No args: --lengths 32768,131072,262144 --densities 0.01,0.02,0.05,0.1 (as the current record,
# docs/bench/2026-12-01-attention-fixm/). Options, in the environment:
#   OUT=DIR           where the files go (default .devout)
#   KERNEL=k=v,...    kernel launch options of both bench runs
#                     (`bench attention --kernel`, e.g. fixm=0,rcp=1; default: kernel.DEFAULTS)
#   KERNEL_TESTS=0    skip the GPU kernel tests run first (pytest -m gpu tests/kernels -k grid)
#   LONG=0            skip the 1M run (--lengths 1048576 --densities 0.01 --skip-flex
#                     --max-ours-dense-len 0: no FlexAttention at 1M, its per-head mask needs 8 GiB)
#   TIMEOUT=S         limit of the main run (200); LONG_TIMEOUT=S of the 1M run (90)
# Writes under $OUT: attention.json, attention.log, attention_1m.json, attention_1m.log,
# kernel_tests.log, smi.csv.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
source "$(dirname "$0")/lib.sh"
gpu_out
gpu_info
kernel=()
[ -n "${KERNEL:-}" ] && kernel=(--kernel "$KERNEL")
if [ "${KERNEL_TESTS:-1}" != 0 ]; then
  timeout 120 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -k grid 2>&1 \
    | tee "$out/kernel_tests.log" | tail -3
fi
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--lengths 32768,131072,262144 --densities 0.01,0.02,0.05,0.1)
gpu_smi_start "$out/smi.csv"
timeout "${TIMEOUT:-200}" python3 -m prefill_server.bench.attention "${kernel[@]}" "${args[@]}" \
  --out "$out/attention.json" 2>&1 | grep -v Warn | tee "$out/attention.log" | tail -n 40
echo "attention rc=$?"
if [ "${LONG:-1}" != 0 ]; then
  timeout "${LONG_TIMEOUT:-90}" python3 -m prefill_server.bench.attention "${kernel[@]}" --lengths 1048576 \
    --densities 0.01 --skip-flex --max-ours-dense-len 0 --out "$out/attention_1m.json" 2>&1 | grep -v Warn \
    | tee "$out/attention_1m.log" | tail -n 6
  echo "attention 1M rc=$?"
fi
gpu_smi_stop
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader

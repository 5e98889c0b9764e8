#!/usr/bin/env bash
# GPU entry: the regression call, to check main on the GPU after CPU-side changes, from the repo root
# on the GPU machine (call with carry: [".whl"], see scripts/gpu/lib.sh):
#   scripts/gpu/regression.sh [extra bench e2e stream args]
# (1) the GPU smoke tests, tests/bench/test_gpu_bench_smoke.py (attention at 128K / 5%, dense e2e
#     at 8K/32K/128K + 64 x 8K against the sustained floors, FP8 64 x 8K over bf16, FP8 128K and 1M
#     streamed; each against its bar or guard: ~7 minutes, so with the stream part below the script
#     needs more than one 10-minute device call: SMOKE=0 for the second); (2) scripts/gpu/stream.sh
#     at 128K (none vs null-push vs nixl, fixed 2%) and 1M (nixl, 2%, default first layer), with the streamed K/V
#     checked against the pull path at 16K. Last recorded: docs/bench/2026-12-01-gpu-regression/.
# Options, in the environment:
#   OUT=DIR          where the files go (default .devout)
#   SMOKE=0          skip the smoke tests; SMOKE_TIMEOUT=S their limit (600)
#   STREAM_TIMEOUT=S limit of the stream bench (300); BUDGET_S=S its --budget-s (280)
# Writes under $OUT: smoke.log and, through stream.sh, stream.json, stream.log, smi.csv.
set -o pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/lib.sh"
gpu_out
gpu_wheels || exit 1
if [ "${SMOKE:-1}" != 0 ]; then
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${SMOKE_TIMEOUT:-600}" python3 -m pytest -q -m gpu -s \
    -p no:cacheprovider tests/bench/test_gpu_bench_smoke.py 2>&1 | grep -v "NIXL INFO" | tee "$out/smoke.log" \
    | tail -25
  echo "smoke rc=$?"
fi
TIMEOUT=${STREAM_TIMEOUT:-300} bash "$(dirname "$0")/stream.sh" --lengths 131072 --densities 0.02 \
  --variants null-push,nixl --estimator-lengths "" --long 1048576 --long-runs nixl:1 --reps 2 \
  --budget-s "${BUDGET_S:-280}" "$@"
if [ -f "$out/smoke.log" ]; then
  echo "---- smoke tests (again, for the tail) ----"
  grep -E "^(128K|8K|32K|64|1M|PASSED|FAILED)|passed|failed" "$out/smoke.log" | tail -12
fi

#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-12-01-gpu-regression/ (was main_regression.sh in scripts/gpu/; git history from
# 198de3e). Paths to moved helpers are updated; options of the bench that were removed since need
# that commit. The GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# One device call that checks main on the GPU after CPU-side changes: the GPU smoke tests
# (tests/bench/test_gpu_bench_smoke.py), then the stream bench at 128K (none vs null-push vs nixl,
# fixed 2%) and 1M (nixl, 2%), with the K/V check against the pull path at 16K.
#   bash docs/bench/2026-12-01-gpu-regression/main_regression.sh   (carry: [".whl"], see scripts/gpu/lib.sh)
# Writes $OUT/smoke.log and, through scripts/gpu/stream.sh, stream.json, stream.log, smi.csv.
set -o pipefail
out=${OUT:-.devout}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
fi
PYTHONPATH=$PWD:/tmp/site timeout "${SMOKE_TIMEOUT:-240}" python3 -m pytest -q -m gpu -s -p no:cacheprovider \
  tests/bench/test_gpu_bench_smoke.py 2>&1 | grep -v "NIXL INFO" | tee "$out/smoke.log" | tail -25
echo "smoke rc=$?"
TIMEOUT=${E2E_TIMEOUT:-300} bash scripts/gpu/stream.sh --lengths 131072 --densities 0.02 \
  --variants null-push,nixl --estimator-lengths "" --long 1048576 --long-runs nixl:1 --reps 2 \
  --budget-s "${BUDGET_S:-280}"
echo "---- smoke tests (again, for the tail) ----"
grep -E "^(128K|8K|32K|64|1M|PASSED|FAILED)|passed|failed" "$out/smoke.log" | tail -12

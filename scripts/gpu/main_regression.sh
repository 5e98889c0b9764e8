#!/usr/bin/env bash
# One device call that checks main on the GPU after CPU-side changes: the GPU smoke tests
# (tests/bench/test_gpu_bench_smoke.py), then the stream bench at 128K (none vs null-push vs nixl,
# fixed 2%) and 1M (nixl, 2%), with the K/V check against the pull path at 16K.
#   scripts/gpu/main_regression.sh        (call with carry: [".whl"], see bench_e2e_stream.sh)
# Writes $OUT/smoke.log and, through bench_e2e_stream.sh, stream.json, stream.log, smi.csv.
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
E2E_TIMEOUT=${E2E_TIMEOUT:-300} bash scripts/gpu/bench_e2e_stream.sh --lengths 131072 --densities 0.02 \
  --variants null-push,nixl --estimator-lengths "" --long 1048576 --long-runs nixl:1 --reps 2 \
  --budget-s "${BUDGET_S:-280}"
echo "---- smoke tests (again, for the tail) ----"
grep -E "^(128K|8K|32K|64|1M|PASSED|FAILED)|passed|failed" "$out/smoke.log" | tail -12

#!/usr/bin/env bash
# Device call 2 (issue 20): SiLU-and-multiply to FP8 in one pass (the row in registers) against the
# two-pass kernel: the GPU tests, a kernel microbench on the 8B shape, and bench e2e 64 x 8K in bf16,
# FP8 (one pass) and FP8 (two passes, SILU_ONE_PASS_MAX=0) in the same call.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 120 python3 -m pytest -q -m gpu tests/layers/test_fp8.py -p no:cacheprovider > "$out/tests.txt" 2>&1
rc=$?; tail -5 "$out/tests.txt"
[ $rc = 0 ] || exit $rc
timeout 90 python3 docs/bench/2026-12-06-fp8-fold/silu_variants.py --out "$out/silu.json" 2>&1 | tail -6
ARGS="--lengths 8192 --reps 1 --throughput 64x8192 --token-budget 65536 --skip-floor --check-len 0"
E2E="python3 -m prefill_server.bench.e2e $ARGS"
timeout 150 $E2E --quantization none --out "$out/e2e_none.json" 2>&1 | grep -i "throughput 64\|error" | tail -2
timeout 150 $E2E --quantization fp8 --profile-throughput 8 --out "$out/e2e_fp8.json" 2>&1 | grep -i "throughput 64\|profile of\|error" | tail -3
timeout 150 python3 -c "import sys, runpy; import prefill_server.layers.fp8 as f; f.SILU_ONE_PASS_MAX = 0
sys.argv = ['e2e'] + sys.argv[1:]; runpy.run_module('prefill_server.bench.e2e', run_name='__main__')" \
  $ARGS --quantization fp8 --profile-throughput 8 --out "$out/e2e_fp8_two_pass.json" 2>&1 | grep -i "throughput 64\|profile of\|error" | tail -3
python3 - "$out" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("e2e_*.json")):
    t = json.loads(f.read_text())["throughput"]; p = t.get("profile") or {}
    print(f.name, t["wall_s"], {k["name"][:28]: round(k["ms"], 1) for k in p.get("top_kernels", [])[:6]})
PY

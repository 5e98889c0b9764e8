#!/usr/bin/env bash
# Device call (issue 20): FP8 scores in the engine (--kv-cache-dtype fp8, --fp8-attention), 64 x 8K.
# The GPU tests of the changed code, then bench e2e throughput in one call: bf16; FP8 linear with
# bf16 pages; FP8 linear + FP8 pages with bf16 scores (--fp8-attention off); FP8 linear + FP8 pages
# + FP8 scores (the default). About 6 minutes.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 240 python3 -m pytest -q -m gpu tests/layers/test_fp8.py tests/layers/test_fused.py \
  tests/kernels/test_paged_attention_fp8.py tests/engine/test_kv_format_engine.py -p no:cacheprovider \
  > "$out/tests.txt" 2>&1
rc=$?; tail -5 "$out/tests.txt"
[ $rc = 0 ] || exit $rc
ARGS="--lengths 8192 --reps 1 --throughput 64x8192 --token-budget 65536 --skip-floor --check-len 0"
E2E="python3 -m prefill_server.bench.e2e $ARGS"
run() {  # name, flags
  local name=$1; shift
  timeout 150 $E2E "$@" --out "$out/e2e_$name.json" 2>&1 | grep -i "throughput 64\|profile of\|error" | tail -3
}
run none --quantization none
run fp8 --quantization fp8
run fp8_kv8 --quantization fp8 --kv-cache-dtype fp8 --fp8-attention off --profile-throughput 8
run fp8_kv8_qk8 --quantization fp8 --kv-cache-dtype fp8 --profile-throughput 8
python3 - "$out" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("e2e_*.json")):
    t = json.loads(f.read_text())["throughput"]; p = t.get("profile") or {}
    print(f.name, round(t["wall_s"], 3), {k["name"][:28]: round(k["ms"], 1) for k in p.get("top_kernels", [])[:7]})
PY

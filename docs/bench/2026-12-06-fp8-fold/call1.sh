#!/usr/bin/env bash
# Device call (issue 20, 64 x 8K in FP8 at 1.6x bf16): the raw-GEMM path (tensorwise FP8 GEMMs, the
# scales applied by the kernels that read gate_up / o_proj / down_proj) checked and timed: the FP8 GPU
# tests, then bench e2e 64 x 8K in bf16 and FP8 in the same call (FP8 with the engine-vs-eager check at
# 8K, a profile of one 8 x 8K step, and at chunk rows 16K and 32K).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 120 python3 -m pytest -q -m gpu tests/layers/test_fp8.py -p no:cacheprovider > "$out/tests.txt" 2>&1
rc=$?; tail -30 "$out/tests.txt"
[ $rc = 0 ] || exit $rc  # (nothing to time when the kernels are wrong)
gpu_smi_start "$out/smi.csv" 500
E2E="python3 -m prefill_server.bench.e2e --lengths 8192 --reps 1 --throughput 64x8192 --token-budget 65536 --skip-floor"
timeout 150 $E2E --quantization none --check-len 0 --out "$out/e2e_none.json" 2>&1 | grep -i "throughput\|error" | tail -3
timeout 200 $E2E --quantization fp8 --check-len 8192 --profile-throughput 8 --out "$out/e2e_fp8.json" 2>&1 \
  | grep -i "throughput\|profile\|check\|error" | tail -6
for c in ${CHUNKS-16384 32768}; do
  timeout 150 $E2E --quantization fp8 --check-len 0 --chunk-tokens $c --profile-throughput 8 \
    --out "$out/e2e_fp8_chunk$c.json" 2>&1 | grep -i "throughput\|profile\|error" | tail -3
done
gpu_smi_stop
python3 - "$out" <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
for f in sorted(o.glob("e2e_*.json")):
    d = json.loads(f.read_text()); t = d.get("throughput") or {}
    print(f.name, "wall_s", t.get("wall_s"), "ttft 8K", [r["ttft_s"] for r in d.get("ttft") or []])
    if d.get("check"): print(" check", {k: v for k, v in d["check"].items() if "rel" in k or "argmax" in k})
    p = t.get("profile")
    if p: print(" profile", p["by_category_ms"], [(k["name"][:40], round(k["ms"], 1)) for k in p["top_kernels"][:12]])
PY

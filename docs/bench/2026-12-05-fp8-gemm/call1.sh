#!/usr/bin/env bash
# Device call 1 (issue 20, 64 x 8K in FP8 at 1.6x bf16): where the FP8 run's time goes and which
# lever is left. GEMM scaling modes at the engine's chunk rows; bench e2e 64 x 8K in bf16 and FP8 in
# the same call (FP8 at chunk 8K / 16K / 32K rows), FP8 with a profile of one 8 x 8K step.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
python3 -m py_compile docs/bench/2026-12-05-fp8-gemm/gemm_scaling.py
timeout 240 python3 docs/bench/2026-12-05-fp8-gemm/gemm_scaling.py --out "$out/gemm.json" 2>&1 | tee "$out/gemm.txt" | grep layer
gpu_smi_start "$out/smi.csv" 500
E2E="python3 -m prefill_server.bench.e2e --lengths 8192 --reps 1 --throughput 64x8192 --token-budget 65536 --skip-floor --check-len 0"
timeout 150 $E2E --quantization none --out "$out/e2e_none.json" 2>&1 | grep -i "throughput\|error" | tail -3
timeout 200 $E2E --quantization fp8 --profile-throughput 8 --out "$out/e2e_fp8.json" 2>&1 | grep -i "throughput\|profile\|error" | tail -4
for c in ${CHUNKS-16384 32768}; do  # CHUNKS="" skips them (a shorter call)
  timeout 150 $E2E --quantization fp8 --chunk-tokens $c --out "$out/e2e_fp8_chunk$c.json" 2>&1 | grep -i "throughput\|error" | tail -2
done
gpu_smi_stop
python3 - "$out" <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
for f in sorted(o.glob("e2e_*.json")):
    d = json.loads(f.read_text()); t = d.get("throughput") or {}
    t = t[0] if isinstance(t, list) else t
    print(f.name, {k: v for k, v in t.items() if isinstance(v, (int, float))} if isinstance(t, dict) else t)
    p = (t or {}).get("profile") if isinstance(t, dict) else None
    if p: print(" profile", p["by_category_ms"], [(k["name"][:60], round(k["ms"], 1)) for k in p["top_kernels"][:12]])
PY

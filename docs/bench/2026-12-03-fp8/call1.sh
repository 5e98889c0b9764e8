#!/usr/bin/env bash
# Device call 1 (issue 20, FP8): the GPU tests, the GEMM microbench, then bench e2e in bf16 and in
# FP8 in the same call (TTFT at 8K / 32K / 128K and 64 x 8K throughput).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/layers/test_fp8.py 2>&1 | tail -5 | tee "$out/tests.txt"
timeout 120 python3 docs/bench/2026-12-03-fp8/gemm.py --out "$out/gemm.json" 2>&1 | tail -12
gpu_smi_start "$out/smi.csv" 200
for q in none fp8; do
  timeout 200 python3 -m prefill_server.bench.e2e --lengths 8192,32768,131072 --reps 3 --throughput 64x8192 \
    --token-budget 65536 --skip-floor --check-len 0 --quantization $q --out "$out/e2e_$q.json" 2>&1 | tail -4
done
gpu_smi_stop
python3 - "$out" <<'PY'
import json, sys
o = sys.argv[1]
r = {q: json.load(open(f"{o}/e2e_{q}.json")) for q in ("none", "fp8")}
for q, d in r.items():
    print(q, [(t["tokens"], round(t["ttft_s"], 3), round(t["peak_mem_gib"], 1)) for t in d["ttft"]],
          "64x8K", round(d["throughput"]["wall_s"], 2), "s")
print("throughput fp8 / bf16:", round(r["none"]["throughput"]["wall_s"] / r["fp8"]["throughput"]["wall_s"], 3))
PY

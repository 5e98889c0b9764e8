#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-12-01-gpu-regression/ (was dense_guard.sh in scripts/gpu/; git history from 5879ee9).
# Paths to moved helpers are updated; options of the bench that were removed since need that commit.
# The GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# One device call: is the dense-TTFT smoke failure of 2026-12-01 (8K 1.215x the burst floor) the
# engine or the floor? (1) the smoke test's e2e part (guard on the sustained floor); (2) dense TTFT
# at 8K/32K of the tree the last A/B measured (.ab_base = `git archive 0e53d3b prefill_server
# kv_transfer`) against the working tree, A B A B; (3) the working tree once more with both floors.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-.devout}; mkdir -p "$out"; out=$(cd "$out" && pwd)
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu,memory.used --format=csv,noheader
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/bench/test_gpu_bench_smoke.py \
  -k e2e 2>&1 | tee "$out/smoke_e2e.log" | grep -E "TTFT|floor|passed|failed|Error"
source docs/bench/2026-12-01-gpu-regression/ab_dense.sh
ab_dense "$out" 5
PYTHONPATH=$PWD timeout 200 python3 -m prefill_server.bench.e2e --lengths 8192,32768 --sustained-floor 8192,32768 \
  --check-len 0 --throughput "" --reps 3 --out "$out/new_floors.json" 2>&1 | tail -6
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
python3 - "$out" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    print(os.path.basename(f), [(r["tokens"], round(r["ttft_s"], 4), round(r.get("ratio", 0), 3),
                                 round(r.get("ratio_vs_sustained_floor", 0), 3)) for r in d.get("ttft", [])])
PY

#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-12-01-e2e-host-prep/ (was host_prep_ab.sh in scripts/gpu/; git history from 0e53d3b).
# Paths to moved helpers are updated; options of the bench that were removed since need that commit.
# The GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# One device call: dense TTFT at 8K/32K, the committed tree (.ab_base = `git archive HEAD prefill_server
# kv_transfer`) vs the working tree, alternating A B A B in one call (the power state drifts), then
# the working tree once more with the floor (TTFT / floor) and a profile of one 8K prefill.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-.devout}; mkdir -p "$out"; out=$(cd "$out" && pwd)
nvidia-smi --query-gpu=name,clocks.sm,power.draw,memory.used --format=csv,noheader
source docs/bench/2026-12-01-gpu-regression/ab_dense.sh
ab_dense "$out" 5
PYTHONPATH=$PWD timeout 240 python3 -m prefill_server.bench.e2e --lengths 8192,32768,131072 --check-len 4096 \
  --throughput "" --reps 3 --profile-len 8192 --out "$out/new_floor.json" 2>&1 | tail -12
python3 - "$out" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    print(os.path.basename(f), [(r["tokens"], round(r["ttft_s"], 4), [round(x, 4) for x in r["reps_s"]],
                                 round(r.get("ratio", 0), 4)) for r in d.get("ttft", [])])
    if "profile" in d:
        p = d["profile"]
        print("  profile 8K: wall %.1f ms, GPU busy %.1f ms" % (p["wall_ms_with_profiler"], p["gpu_busy_ms"]), p["by_category_ms"])
PY

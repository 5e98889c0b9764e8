#!/usr/bin/env bash
# GPU entry: `prefill-server bench e2e` (dense prefill end to end through the real engine on random
# Llama-3.1-8B weights: TTFT against the floor measured in the same run, the engine-vs-reference
# check, 64 x 8K throughput; sparse attention in the throughput run with --throughput-densities),
# from the repo root on the GPU machine:
#   scripts/gpu/e2e.sh [bench e2e args]         (no args: the bench's defaults, 8K/32K/128K + 64 x 8K)
# e.g. the current record's runs: --lengths 8192,32768,131072 --check-len 4096 --throughput "" --reps 3
# (docs/bench/2026-12-01-e2e-host-prep/), --lengths 8192 --check-len 0 --throughput 64x8192
# --throughput-floor --profile-throughput 8 --sustained-floor 8192 (docs/bench/2026-12-01-e2e-stream-nixl/).
# Options, in the environment:
#   OUT=DIR        where the files go (default .devout)
#   TIMEOUT=S      limit of the bench run (420)
#   AB_BASE=DIR    also a before/after in the same call, before the bench run: DIR holds another
#                  tree (`git archive <rev> prefill_server kv_transfer | tar -x -C DIR`, carried);
#                  dense TTFT (engine only: no floor, no check, no throughput) at AB_LENGTHS
#                  (8192,32768), AB_REPS (5) reps, DIR's tree then this one, AB_ROUNDS (2) times
#                  (alternating: the GPU's power state drifts within a call). Each run's limit AB_TIMEOUT (150);
#                  AB_ARGS: more bench e2e args for those runs (e.g. "--preset tiny --device cpu" to try it).
# Writes under $OUT: e2e.json, e2e.log, smi.csv; with AB_BASE ab_base_<round>.json, ab_new_<round>.json.
set -o pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/lib.sh"
gpu_out
gpu_info
if [ -n "${AB_BASE:-}" ]; then
  [ -d "$AB_BASE" ] || { echo "AB_BASE=$AB_BASE: no such folder"; exit 2; }
  ab=(--lengths "${AB_LENGTHS:-8192,32768}" --skip-floor --check-len 0 --throughput "" --reps "${AB_REPS:-5}"
      ${AB_ARGS:-})
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do  # run from inside each tree: `-m` puts the cwd first
    (cd "$AB_BASE" && PYTHONPATH=$PWD timeout "${AB_TIMEOUT:-150}" python3 -m prefill_server.bench.e2e "${ab[@]}" \
       --out "$out/ab_base_$round.json" 2>&1 | tail -3)
    PYTHONPATH=$PWD timeout "${AB_TIMEOUT:-150}" python3 -m prefill_server.bench.e2e "${ab[@]}" \
      --out "$out/ab_new_$round.json" 2>&1 | tail -3
  done
fi
gpu_smi_start "$out/smi.csv" 100
PYTHONPATH=$PWD timeout "${TIMEOUT:-420}" python3 -m prefill_server.bench.e2e --out "$out/e2e.json" "$@" 2>&1 \
  | tee "$out/e2e.log"
echo "e2e rc=$?"
gpu_smi_stop
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
python3 - "$out" <<'PY'  # TTFT per file, for the console tail (ratio: to the burst floor / the sustained one)
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    print(os.path.basename(f), [(r["tokens"], round(r["ttft_s"], 4), round(r.get("ratio", 0), 3),
                                 round(r.get("ratio_vs_sustained_floor", 0), 3)) for r in d.get("ttft", [])])
    tp = d.get("throughput")
    if tp:
        print("  throughput", tp["requests"], "x", tp["tokens_each"], round(tp["wall_s"], 2), "s",
              round(tp.get("of_linear_floor", 0), 3), "of the linear floor,",
              round(tp.get("ratio_vs_sustained_floor", 0), 3), "x its sustained floor")
    for name, c in d.get("clocks", {}).items():
        print("  clocks", name, c)
PY

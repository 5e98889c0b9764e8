# RECORD, not an entry point: a helper of the recorded calls here (e2e.sh AB_BASE does this now), in
# docs/bench/2026-12-01-gpu-regression/ (was ab_dense.sh in scripts/gpu/; git history from 5879ee9).
# Paths to moved helpers are updated; options of the bench that were removed since need that commit.
# The GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# Sourced by the device-call scripts: dense TTFT at 8K/32K (engine only, no floor), the tree in
# .ab_base (`git archive <commit> prefill_server kv_transfer`) against the working tree, alternating
# A B A B (the GPU's power state drifts within a call).   ab_dense OUT_DIR REPS
ab_dense() {
  local out=$1 args=(--lengths 8192,32768 --skip-floor --check-len 0 --throughput "" --reps "$2")
  for round in 1 2; do
    (cd .ab_base && PYTHONPATH=$PWD timeout 150 python3 -m prefill_server.bench.e2e "${args[@]}" \
       --out "$out/base_$round.json" 2>&1 | tail -3)
    PYTHONPATH=$PWD timeout 150 python3 -m prefill_server.bench.e2e "${args[@]}" --out "$out/new_$round.json" 2>&1 | tail -3
  done
}

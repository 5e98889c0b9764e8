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

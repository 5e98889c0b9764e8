#!/usr/bin/env bash
# One device call for `prefill-server bench e2e` (run from the repo root on the GPU machine):
#   scripts/gpu/bench_e2e.sh [extra bench args]
# Writes $OUT/e2e.json + e2e.log. With E2E_BASELINE=<dir holding an older prefill_server package>
# (e.g. `git archive <rev> prefill_server | tar -x -C <dir>` plus this tree's bench/e2e.py) it also
# times that tree at E2E_BASELINE_LENGTHS for a before/after in the same call.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-.devout}
mkdir -p "$out" && out=$(cd "$out" && pwd)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
# SM clock / power / throttle reasons every 100 ms, to line up with the bench's "phases"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader -lms 100 > "$out/smi.csv" 2>&1 &
smi=$!
PYTHONPATH=$PWD timeout "${E2E_TIMEOUT:-420}" python3 -m prefill_server.bench.e2e --out "$out/e2e.json" "$@" 2>&1 \
  | tee "$out/e2e.log"
kill "$smi" 2>/dev/null
if [ -n "$E2E_BASELINE" ] && [ -d "$E2E_BASELINE" ]; then  # run from inside it: `-m` puts the cwd first
  (cd "$E2E_BASELINE" && PYTHONPATH=$PWD timeout "${E2E_BASELINE_TIMEOUT:-150}" python3 -m prefill_server.bench.e2e \
    --lengths "${E2E_BASELINE_LENGTHS:-8192,32768}" --skip-floor --check-len 0 --throughput "" --reps 2 \
    --out "$out/e2e_baseline.json" 2>&1 | tee "$out/e2e_baseline.log")
fi

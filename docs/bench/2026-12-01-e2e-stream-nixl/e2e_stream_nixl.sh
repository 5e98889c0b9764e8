#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-12-01-e2e-stream-nixl/ (was e2e_stream_nixl.sh in scripts/gpu/; git history from
# 1a8a54e). Paths to moved helpers are updated; options of the bench that were removed since need
# that commit. The GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# Issue 6, third slice: one device call that (1) finds an environment in which NIXL moves CUDA
# memory between two processes (docs/bench/2026-12-01-e2e-stream-nixl/nixl_vram_probe.py under each candidate below), (2) runs
# `prefill-server bench e2e stream` at 128K (none / null-push / nixl / nixl-sync) and 1M (nixl) in
# the first one that works, (3) runs `prefill-server bench e2e` on 64 x 8K with the throughput
# step's floor and a profile. From the tree to measure (e.g. a `git archive` snapshot), with the
# wheels in $WHL (default .whl; call with carry [".whl", <snapshot>]):
#   WHL=../.whl bash docs/bench/2026-12-01-e2e-stream-nixl/e2e_stream_nixl.sh
# Wheels: nixl==1.5.1, nixl-cu12==1.5.1 and nixl-cu13==1.5.1 (each repacked without nixl_ep_cu*/,
# nixl_cu*.scripts/ and UCX's perftest library: 27 + 28 MB), msgspec==0.23.0, pyzmq==27.3.0.
# Writes under $OUT: probes.jsonl, ucx_debug.txt, stream.json, stream.log, e2e_tp.json, e2e_tp.log, smi.csv.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-.devout}
mkdir -p "$out" && out=$(cd "$out" && pwd)
whl=${WHL:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$whl"/*.whl || exit 1
# nixl's meta package imports nixl_cu<torch's CUDA major>; NIXL_CUDA_MAJOR overrides that here.
sed -i 's/^def detect_cuda_major() -> int | None:$/&\n    import os\n    if os.environ.get("NIXL_CUDA_MAJOR"):\n        return int(os.environ["NIXL_CUDA_MAJOR"])/' \
  /tmp/site/nixl_meta_utils.py
export PYTHONPATH=/tmp/site:$PWD
date -u +%FT%TZ
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

# 1. which environment lets NIXL WRITE VRAM -> VRAM across processes (run 1-2: nixl-cu12 with the
#    defaults failed: "VRAM memory is detected as host by UCX")
ok=""
for env in "NIXL_CUDA_MAJOR=13" "NIXL_CUDA_MAJOR=13 UCX_MEMTYPE_CACHE=n" \
           "NIXL_CUDA_MAJOR=13 UCX_MEMTYPE_CACHE=n PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" \
           "NIXL_CUDA_MAJOR=12 UCX_MEMTYPE_CACHE=n" \
           "NIXL_CUDA_MAJOR=12 UCX_MEMTYPE_CACHE=n PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" \
           "NIXL_CUDA_MAJOR=12"; do
  line=$(env $env timeout 60 python3 docs/bench/2026-12-01-e2e-stream-nixl/nixl_vram_probe.py 2>/dev/null | grep '^PROBE ')
  [ -n "$line" ] || line="PROBE no answer with: $env"
  echo "$line" | tee -a "$out/probes.jsonl"
  if [ -z "$ok" ] && echo "$line" | grep -q '"ok": true'; then ok="$env"; fi
done
# UCX's own words on the memory type, for the default cu13 and cu12 environments
for m in 13 12; do
  echo "== NIXL_CUDA_MAJOR=$m UCX_LOG_LEVEL=debug" >> "$out/ucx_debug.txt"
  NIXL_CUDA_MAJOR=$m UCX_LOG_LEVEL=debug timeout 60 python3 docs/bench/2026-12-01-e2e-stream-nixl/nixl_vram_probe.py 2>&1 \
    | grep -i -E "memtype|mem_type|memory type|cuda_copy|cuda_ipc|detected as host|PROBE" \
    | grep -v -E "NIXL INFO" | head -25 >> "$out/ucx_debug.txt"
done
echo "== NIXL works with: ${ok:-nothing}"

nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,memory.used,clocks_event_reasons.active \
  --format=csv,noheader -lms 200 > "$out/smi.csv" 2>&1 &
smi=$!
# 2. streaming at 128K and 1M with a receiver process, in that environment
if [ -n "$ok" ]; then
  (export $ok; date -u +%FT%TZ; timeout "${STREAM_TIMEOUT:-300}" python3 -m prefill_server.bench.stream \
    --out "$out/stream.json" --lengths 131072 --densities 0.02 --estimator-lengths "" \
    --variants null-push,nixl,nixl-sync --reps 3 --check-len 16384 --long 1048576 --long-runs nixl:0 \
    --budget-s "${STREAM_BUDGET:-230}" 2>&1 | tee "$out/stream.log" | grep -v -e "NIXL INFO" -e "^\[receiver\]"
   echo "stream rc=$?")
fi
# 3. 64 x 8K throughput: the step's floor work back to back, and a profile of one step (8 x 8K)
date -u +%FT%TZ
timeout "${TP_TIMEOUT:-200}" python3 -m prefill_server.bench.e2e --out "$out/e2e_tp.json" --lengths 8192 \
  --reps 3 --check-len 0 --throughput 64x8192 --token-budget 65536 --throughput-floor --profile-throughput 8 \
  --sustained-floor 8192 2>&1 | tee "$out/e2e_tp.log"
echo "e2e rc=$?"
kill "$smi" 2>/dev/null

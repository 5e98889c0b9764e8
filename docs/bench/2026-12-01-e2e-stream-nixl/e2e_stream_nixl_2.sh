#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-12-01-e2e-stream-nixl/ (was e2e_stream_nixl_2.sh in scripts/gpu/; git history from
# c29ccdb). Paths to moved helpers are updated; options of the bench that were removed since need
# that commit. The GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# Issue 6, third slice, second device call (after docs/bench/2026-12-01-e2e-stream-nixl/e2e_stream_nixl.sh found that
# nixl-cu13 registers VRAM and streams at 1.002x at 128K, with WRITEs of ~5 GB/s):
#  (1) NIXL WRITE bandwidth between two processes on the GPU (512 MiB, 5 reps) under a few UCX
#      transport settings, and UCX's protocol choice for it (UCX_PROTO_INFO);
#  (2) 1M tokens streamed (nixl) vs the push path sending nothing (null-push), layer 0 sparse;
#  (3) 64 x 8K throughput again, dense and with the sparse kernel at fixed densities.
#   WHL=../.whl bash docs/bench/2026-12-01-e2e-stream-nixl/e2e_stream_nixl_2.sh       (carry [".whl", <snapshot>])
# Writes under $OUT: probes.jsonl, ucx_proto.txt, stream.json, stream.log, e2e_tp.json, e2e_tp.log, smi.csv.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-.devout}
mkdir -p "$out" && out=$(cd "$out" && pwd)
whl=${WHL:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$whl"/*.whl || exit 1
sed -i 's/^def detect_cuda_major() -> int | None:$/&\n    import os\n    if os.environ.get("NIXL_CUDA_MAJOR"):\n        return int(os.environ["NIXL_CUDA_MAJOR"])/' \
  /tmp/site/nixl_meta_utils.py
export PYTHONPATH=/tmp/site:$PWD NIXL_CUDA_MAJOR=13
date -u +%FT%TZ
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw,memory.used --format=csv,noheader
nvidia-smi topo -m 2>&1 | head -5

# 1. bandwidth of one cross-process VRAM -> VRAM WRITE
for env in "UCX_TLS_DEFAULT=1" "UCX_TLS=cuda_ipc,cuda_copy,self,sm" "UCX_TLS=cuda_ipc,cuda_copy,self,tcp" \
           "UCX_TLS=^cuda_ipc"; do
  line=$(env $env PROBE_MB=512 PROBE_REPS=5 PROBE_DESCS=16 timeout 90 python3 docs/bench/2026-12-01-e2e-stream-nixl/nixl_vram_probe.py 2>/dev/null \
         | grep '^PROBE ')
  [ -n "$line" ] || line="PROBE no answer with: $env"
  echo "$env $line" | tee -a "$out/probes.jsonl"
done
UCX_PROTO_INFO=y PROBE_MB=512 PROBE_REPS=2 PROBE_DESCS=16 timeout 90 python3 docs/bench/2026-12-01-e2e-stream-nixl/nixl_vram_probe.py 2>&1 \
  | grep -v "NIXL INFO" | head -150 > "$out/ucx_proto.txt"
grep -i -E "put|write|cuda_ipc|cuda_copy|rndv" "$out/ucx_proto.txt" | head -30

nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,memory.used,clocks_event_reasons.active \
  --format=csv,noheader -lms 200 > "$out/smi.csv" 2>&1 &
smi=$!
# 2. 1M streamed vs nothing sent (both with the first layer sparse: the run that meets <= 45 s)
date -u +%FT%TZ
timeout "${STREAM_TIMEOUT:-240}" python3 -m prefill_server.bench.stream --out "$out/stream.json" --lengths "" \
  --densities 0.02 --estimator-lengths "" --variants null-push,nixl --check-len 16384 --long 1048576 \
  --long-runs null-push:0,nixl:0 2>&1 | tee "$out/stream.log" | grep -v -e "NIXL INFO" -e "^\[receiver\]"
echo "stream rc=$?"
# 3. 64 x 8K: dense (again: run-to-run spread) and sparse at fixed kernel densities
date -u +%FT%TZ
timeout "${TP_TIMEOUT:-150}" python3 -m prefill_server.bench.e2e --out "$out/e2e_tp.json" --lengths 8192 \
  --reps 1 --check-len 0 --throughput 64x8192 --token-budget 65536 --throughput-densities 0.3,0.5 2>&1 \
  | tee "$out/e2e_tp.log"
echo "e2e rc=$?"
kill "$smi" 2>/dev/null

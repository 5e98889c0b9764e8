#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-12-01-e2e-stream-nixl/ (was e2e_stream_nixl_3.sh in scripts/gpu/; git history from
# 8e2a303). Paths to moved helpers are updated; options of the bench that were removed since need
# that commit. The GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# Issue 6, third slice, third device call: call 2 found that with UCX's default transports a
# cross-process VRAM -> VRAM WRITE on this one-GPU machine runs at ~0.5-5 GB/s, and at ~1 TB/s with
# UCX_TLS=cuda_ipc,cuda_copy,tcp,self (no shared-memory transports). (1) the probe again under the
# default and that setting; (2) the streaming bench (128K: none / null-push / nixl / nixl-sync,
# 1M: nixl) under that setting.
#   WHL=../.whl bash docs/bench/2026-12-01-e2e-stream-nixl/e2e_stream_nixl_3.sh       (carry [".whl", <snapshot>])
# Call 4: PROBES=0 VARIANTS=nixl,nixl-reap LONG_RUNS=nixl-reap:0 (the Reaper experiment).
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-.devout}
mkdir -p "$out" && out=$(cd "$out" && pwd)
whl=${WHL:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$whl"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
date -u +%FT%TZ
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw,memory.used --format=csv,noheader
tls=${STREAM_UCX_TLS:-cuda_ipc,cuda_copy,tcp,self}
for env in $([ "${PROBES:-1}" = 1 ] && echo "UCX_TLS_DEFAULT=1 UCX_TLS=$tls"); do
  line=$(env $env PROBE_MB=512 PROBE_REPS=5 PROBE_DESCS=16 timeout 90 python3 docs/bench/2026-12-01-e2e-stream-nixl/nixl_vram_probe.py 2>/dev/null \
         | grep '^PROBE ')
  echo "$env ${line:-PROBE no answer}" | tee -a "$out/probes.jsonl"
done
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,memory.used,clocks_event_reasons.active \
  --format=csv,noheader -lms 200 > "$out/smi.csv" 2>&1 &
smi=$!
date -u +%FT%TZ
UCX_TLS=$tls timeout "${STREAM_TIMEOUT:-300}" python3 -m prefill_server.bench.stream --out "$out/stream.json" \
  --lengths 131072 --densities 0.02 --estimator-lengths "" --variants "${VARIANTS:-null-push,nixl,nixl-sync}" \
  --reps 3 --check-len 16384 --long 1048576 --long-runs "${LONG_RUNS:-nixl:0}" 2>&1 | tee "$out/stream.log" \
  | grep -v -e "NIXL INFO" -e "^\[receiver\]"
echo "stream rc=$?"
kill "$smi" 2>/dev/null

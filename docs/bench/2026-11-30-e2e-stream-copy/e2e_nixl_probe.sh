#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-11-30-e2e-stream-copy/ (was e2e_nixl_probe.sh in scripts/gpu/; git history from
# e2a1999). Paths to moved helpers are updated; options of the bench that were removed since need
# that commit. The GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# Why NIXL's VRAM registration fails on the GPU machine (runs 1-2 of bench_e2e_stream.sh), and the
# 128K streaming runs with the first environment that makes it work. Call with carry [".whl"].
out=${OUT:-.devout}; mkdir -p "$out"
[ -d /tmp/site/nixl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
sed -i 's/^def detect_cuda_major() -> int | None:$/&\n    return 12/' /tmp/site/nixl_meta_utils.py
L=/tmp/site/nixl_cu12.libs
export PYTHONPATH=/tmp/site:$PWD
echo "PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF"; echo "== ldd libuct_cuda"; ldd $L/ucx/libuct_cuda.so.0.0.0 | grep -E "not found|libcuda|nvidia-ml"
echo "== ldconfig"; ldconfig -p | grep -E "libcuda.so|libnvidia-ml" | head -4
ml=$(find / -xdev -name "libnvidia-ml.so.1" 2>/dev/null | head -1); echo "nvml at: $ml"
P='import torch;from kv_transfer.nixl import NixlAgent;a=NixlAgent("p");a.register(torch.zeros(1<<20,device="cuda"));print("VRAM-OK")'
echo "== debug log of a plain probe"
UCX_LOG_LEVEL=debug python3 -c "$P" 2>&1 | grep -i -E "cuda|VRAM-OK|memtype|mem_type" | grep -v -E "NIXL INFO|module.c" | head -12
ok=""
for env in "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" "UCX_MODULE_DIR=$L/ucx" "UCX_MODULE_DIR=$L/ucx UCX_TLS=cuda_copy,cuda_ipc,sm,tcp,self" \
           "LD_LIBRARY_PATH=$(dirname "${ml:-/x/x}"):$L UCX_MODULE_DIR=$L/ucx UCX_TLS=cuda_copy,cuda_ipc,sm,tcp,self"; do
  if env $env python3 -c "$P" 2>&1 | grep -q VRAM-OK; then ok="$env"; break; else echo "failed with: $env"; fi
done
echo "== works with: ${ok:-nothing}"
[ -n "$ok" ] || exit 0
export $ok
timeout 120 python3 -m prefill_server.bench.stream --out "$out/stream.json" --densities 0.02 --estimator-lengths "" \
  --long "" --variants nixl,nixl-async --check-len 16384 --reps 2 2>&1 | tee "$out/stream.log" | grep -v -e "NIXL INFO" -e "^\[receiver\]"

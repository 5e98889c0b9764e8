#!/usr/bin/env bash
# Device call 2: call 1's best (pipe=1, tstore=1) as the engine's sparse kernel on sm_90
# (prefill_server/kernels/block_sparse/ws_kernel.py, kernel.DEFAULTS gluon=1, flagged items redone by
# kernel.redo_flagged). Its GPU tests; `bench attention` at 128K 1 / 2 / 5% (the bar's command: the
# default launch is now this kernel); and the same masks against the Triton kernel (triton=1).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_block_sparse_triton.py -p no:cacheprovider \
  -k "warp_specialised or gpu_fixed_reference or strided" 2>&1 | tee "$out/kernel_tests.log" | tail -6
mkdir -p "$out/attn"
OUT=$out/attn KERNEL_TESTS=0 LONG=0 TIMEOUT=150 scripts/gpu/attention.sh --lengths 131072 \
  --densities 0.01,0.02,0.05 --skip-flex 2>&1 | tail -8
rm -f "$out/attn/smi.csv"
timeout 150 python3 docs/bench/2026-12-06-gluon-ws/bench.py time --out "$out/time.json" --tokens 131072 \
  --densities 0.01,0.02 --rounds 2 --variants "triton=1" 2>&1 | tail -8
echo "time rc=$?"

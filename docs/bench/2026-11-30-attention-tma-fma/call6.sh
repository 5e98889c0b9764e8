#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-11-30-attention-tma-fma/ (was call6.sh in scripts/gpu/; git history from a431d2f).
# Paths to moved helpers are updated; options of the bench that were removed since need that commit.
# The GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# GPU call 6 (2026-11-30): the new default (fma=1, kvload=2) through the GPU tests (bf16 and fp16,
# full size, varlen with q_len < k_len, grid scheme) and the benchmark command at 128K and 256K
# (cuDNN, FlexAttention, ours, estimator, same run), then 1M at 1% with cuDNN dense in the same run.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
timeout 60 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -k grid 2>&1 | tail -3
timeout 150 python3 -m prefill_server.bench.attention --lengths 131072,262144 \
  --densities 0.01,0.02,0.05,0.1 --out $OUT/bench.json 2>&1 | grep -v Warn | tail -n 24
timeout 85 python3 -m prefill_server.bench.attention --lengths 1048576 --densities 0.01 --skip-flex \
  --max-ours-dense-len 0 --out $OUT/bench_1m.json 2>&1 | grep -v Warn | tail -n 6
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader

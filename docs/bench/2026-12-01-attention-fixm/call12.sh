#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-12-01-attention-fixm/ (was call12.sh in scripts/gpu/; git history from 3024db3). Paths
# to moved helpers are updated; options of the bench that were removed since need that commit. The
# GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# GPU call 12 (issue 5): the shipped default (fixm=1) once more, for the record: the GPU kernel tests
# and the variant/fallback tests (the fp32 case now against the online kernel), then the benchmark
# command at 32K/128K/256K (1-10%) and 1M (1%), cuDNN and FlexAttention in the same run.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
timeout 90 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -k grid 2>&1 | tail -2
timeout 90 python3 -m pytest -q tests/kernels/test_block_sparse_triton.py -p no:cacheprovider \
  -k "far_key or softmax_variants" 2>&1 | tail -2
timeout 200 python3 -m prefill_server.bench.attention --lengths 32768,131072,262144 \
  --densities 0.01,0.02,0.05,0.1 --out $OUT/bench.json 2>&1 | grep -v Warn | tail -n 36
timeout 85 python3 -m prefill_server.bench.attention --lengths 1048576 --densities 0.01 --skip-flex \
  --max-ours-dense-len 0 --out $OUT/bench_1m.json 2>&1 | grep -v Warn | tail -n 6
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader

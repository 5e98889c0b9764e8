#!/usr/bin/env bash
# GPU call 2: GPU tests (all launch schemes), launch-scheme/tiling sweep at 128K, estimator parts.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -x 2>&1 | tail -5
timeout 400 python3 scripts/gpu/bsa_tune.py --out $OUT/tune.json 2>&1 | tee $OUT/tune.log | grep -v Warning

#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-11-29-attention-h200/ (was call2.sh in scripts/gpu/; git history from bdaed6a). Paths
# to moved helpers are updated; options of the bench that were removed since need that commit. The
# GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# GPU call 2: GPU tests (all launch schemes), launch-scheme/tiling sweep at 128K, estimator parts.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -x 2>&1 | tail -5
timeout 400 python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --out $OUT/tune.json 2>&1 | tee $OUT/tune.log | grep -v Warning

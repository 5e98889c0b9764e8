#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-11-29-attention-h200/ (was call1.sh in scripts/gpu/; git history from bdaed6a). Paths
# to moved helpers are updated; options of the bench that were removed since need that commit. The
# GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# GPU call 1: environment, GPU tests, tuning sweep. Run from the repo root on the device machine.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 200 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -x 2>&1 | tail -15
timeout 360 python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --out $OUT/tune.json 2>&1 | tee $OUT/tune.log | grep -v Warning

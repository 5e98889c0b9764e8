#!/usr/bin/env bash
# GPU call 1: environment, GPU tests, tuning sweep. Run from the repo root on the device machine.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 200 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -x 2>&1 | tail -15
timeout 360 python3 scripts/gpu/bsa_tune.py --out $OUT/tune.json 2>&1 | tee $OUT/tune.log | grep -v Warning

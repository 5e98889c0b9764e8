#!/usr/bin/env bash
# GPU call 5 (2026-11-30): bf16 correctness of the launch variants (scale folded into the exp2 FMA,
# K/V through TMA descriptors, both) vs the reference, then each variant vs cuDNN dense and
# FlexAttention on the same masks at 128K (all) and 256K (the two fastest + the old default), and the
# estimator, in one run. Run from the repo root on the device machine.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
timeout 270 python3 scripts/gpu/bsa_tune.py --tokens 131072,262144 --finalists 2 \
  --out $OUT/tune.json --best $OUT/best.txt > $OUT/tune.log 2>&1
echo "rc=$?"; grep -v Warn $OUT/tune.log | tail -n 70
echo "best: $(cat $OUT/best.txt 2>/dev/null)"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader

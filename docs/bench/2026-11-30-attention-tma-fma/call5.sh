#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-11-30-attention-tma-fma/ (was call5.sh in scripts/gpu/; git history from a431d2f).
# Paths to moved helpers are updated; options of the bench that were removed since need that commit.
# The GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# GPU call 5 (2026-11-30): bf16 correctness of the launch variants (scale folded into the exp2 FMA,
# K/V through TMA descriptors, both) vs the reference, then each variant vs cuDNN dense and
# FlexAttention on the same masks at 128K (all) and 256K (the two fastest + the old default), and the
# estimator, in one run. Run from the repo root on the device machine.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
timeout 270 python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --tokens 131072,262144 --finalists 2 \
  --out $OUT/tune.json --best $OUT/best.txt > $OUT/tune.log 2>&1
echo "rc=$?"; grep -v Warn $OUT/tune.log | tail -n 70
echo "best: $(cat $OUT/best.txt 2>/dev/null)"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader

#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-12-01-attention-rcp/ (was call7.sh in scripts/gpu/; git history from 1adbf54). Paths
# to moved helpers are updated; options of the bench that were removed since need that commit. The
# GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# GPU call 7 (issue 5, 128K at 2%): bf16 correctness of the new launch options (reciprocal epilogue,
# item scalars from Layout.slot_info in one round trip, diagonal tiles in the TMA loop, L2 prefetch
# of a later item's queries, BN=32 with 3 stages) against the reference (output and LSE poisoned
# with NaN), then every variant vs cuDNN dense and FlexAttention on the same masks at 128K in
# interleaved rounds (3 at 2%, 2 at 5% and 10%), the two best and the baseline at 256K, cuDNN at the
# start and end of each length, in one run. Run from the repo root on the device machine.
# Runs as recorded at commit 1adbf54 only (the options were dropped after call 8).
# Variants of this call (bsa_tune.py's VARIANTS then), all grid, gp 4, tok 32, 8 warps,
# maxnreg 128, 2 CTAs/SM, fma 1, kvload 2, as (bn, stages, rcp, meta, diag, pref): (64, 2, 0, 0, 0, 0),
# (64, 2, 1, 0, 0, 0), (64, 2, 1, 1, 0, 0), (64, 2, 1, 1, 1, 0), (64, 2, 1, 1, 1, 264), (32, 3, 1, 1, 1, 0),
# (32, 3, 1, 1, 1, 264).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
timeout 400 python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --tokens 131072,262144 --finalists 2 --rounds 3,2,2 \
  --budget-ms 600 --out $OUT/tune.json --best $OUT/best.txt > $OUT/tune.log 2>&1
echo "rc=$?"; grep -v Warn $OUT/tune.log | tail -n 40
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader

#!/usr/bin/env bash
# Device call 3 (issue 20): `prefill-server bench attention` at 128K and 256K, 1 / 2 / 5 / 10%, with
# FlexAttention tuned on every mask over three configurations (inductor's max-autotune left out: its
# autotuning took 80 s at 128K in call 2, chose a slower configuration than the default there, and
# did not finish at 256K within the call), then the 1M run (our kernel alone; Flex's per-head mask
# would need 8 GiB).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-.devout} KERNEL_TESTS=0 TIMEOUT=400 LONG_TIMEOUT=120 scripts/gpu/attention.sh \
  --lengths 131072,262144 --densities 0.01,0.02,0.05,0.1 --flex-configs default,tma,tma_safe_prescale \
  2>&1 | grep -v "^ *$" | tail -45

#!/usr/bin/env bash
# Device calls 1 and 2 (issue 20, bars against a sustained floor): dense TTFT at 8K / 32K / 128K
# and 64 x 8K throughput, each against its floor's work run back to back in the same run, with
# the SM clock and board power per phase (NVML). Run from the repo root on the H200:
#   bash docs/bench/2026-12-03-sustained-floor/call.sh
set -o pipefail
OUT=${OUT:-.devout} TIMEOUT=540 scripts/gpu/e2e.sh --lengths 8192,32768,131072 --sustained-floor 8192,32768,131072 \
  --check-len 0 --throughput 64x8192 --token-budget 65536 --throughput-floor --reps 3 2>&1 \
  | grep -v -e "^ttft {" -e "^floor " -e "^check_fused"

#!/usr/bin/env bash
# Device call 3: the candidates for fewer programs and a cheaper diagonal, 128K at 1 / 2 / 5%:
# KO 64 (two items per program), KO 128 (a 32-key masked tile where 32 keys suffice), both (192),
# the shipped kernel at 64 tokens x 4 heads per program (M=256, 16 warps, one program per SM) and with
# its own two-items-per-program option (pair=2: kernel.py at commit 354ff8a, removed after this call);
# plus how much of the timed span is the host's launch work (knockout.py's launch_gap).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/lib.sh
gpu_out
gpu_info | tee "$out/info.txt"
timeout 480 python3 docs/bench/2026-12-06-kernel-knockout/knockout.py --out "$out/ko.json" \
  --densities 0.01,0.02,0.05 --kos 0,64,128,192 --rounds 3 \
  --shipped-opts "tok64w16:tok=64,num_warps=16;pair2:pair=2" 2>&1 | tail -60
echo "rc=$?"

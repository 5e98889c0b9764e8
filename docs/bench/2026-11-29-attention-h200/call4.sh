#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-11-29-attention-h200/ (was call4.sh in scripts/gpu/; git history from bdaed6a). Paths
# to moved helpers are updated; options of the bench that were removed since need that commit. The
# GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# GPU call 4: tiling sweep around the default (GQA packing 1/2/4 heads, M=64 programs, BN=32), then the
# benchmark at 8K-256K (cuDNN, Flex, ours) and the 1M estimator + 1% kernel, with the fastest variant.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 150 python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --no-flex --out $OUT/tune.json --best $OUT/best.txt > $OUT/tune.log 2>&1
grep -v Warn $OUT/tune.log | grep -E "ranked|ours_sparse|dense|estimator|error|flips" | tail -n 32
KV=$(cat $OUT/best.txt 2>/dev/null); echo "best: $KV"
timeout 250 python3 -m prefill_server.bench.attention --kernel "$KV" --lengths 8192,16384,131072,262144 \
  --densities 0.01,0.02,0.05,0.1 --out $OUT/bench.json 2>&1 | grep -v Warn | tail -n 44
timeout 100 python3 -m prefill_server.bench.attention --kernel "$KV" --lengths 1048576 --densities 0.01 \
  --max-dense-len 0 --skip-flex --out $OUT/bench_1m.json 2>&1 | grep -v Warn | tail -n 6

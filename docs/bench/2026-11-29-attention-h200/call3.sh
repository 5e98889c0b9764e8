#!/usr/bin/env bash
# RECORD, not an entry point: this device call as it was run, kept with its data in
# docs/bench/2026-11-29-attention-h200/ (was call3.sh in scripts/gpu/; git history from bdaed6a). Paths
# to moved helpers are updated; options of the bench that were removed since need that commit. The
# GPU entry points are scripts/gpu/attention.sh, e2e.sh, stream.sh, regression.sh.
# GPU call 3: GPU tests of the merged/persistent schemes, launch sweep at 128K (writes the fastest
# variant), then the full benchmark with that variant. Run from the repo root on the device machine.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 60 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -k "merged or persistent" 2>&1 | tail -3
timeout 190 python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --out $OUT/tune.json --best $OUT/best.txt > $OUT/tune.log 2>&1
grep -v Warn $OUT/tune.log | tail -n 45
KV=$(cat $OUT/best.txt 2>/dev/null); echo "best: $KV"
timeout 320 python3 -m prefill_server.bench.attention --kernel "$KV" --out $OUT/bench.json 2>&1 | grep -v Warn | tail -n 45

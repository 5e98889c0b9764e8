"""The pool's cost and its scaling on this CPU box, through the documented CLI (transfer mode local,
the embedded SmolLM2 in float32: bf16 is emulated on an AVX2-only CPU): the same server in-process, with --workers 1, and with --workers 2, started
one after another in the same run.

overhead: 20 sequential requests of a 64-token prompt (one token answered: the request's time is
          its TTFT), after 3 warm-up requests: the median over HTTP, and over gRPC the median of
          (the client's time - the engine's queue + prefill time), which leaves out the compute
          (noisy on a shared 2-core box) and keeps what the pool adds (the Ray hop)
scaling:  16 requests of 1,000 distinct tokens, 4 in flight; prompt tokens per second

    .venv/bin/python docs/bench/2026-12-02-pool/bench.py --out result.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from prefill_server.client import PrefillClient

EXE = str(pathlib.Path(sys.executable).parent / "prefill-server")


def serve(flags: list[str], log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([EXE, "serve", "--transfer-mode", "local", "--port", "0", "--grpc-port", "0",
                             "--kv-cache-gib", "0.3", "--dtype", "float32", "--max-queue-wait", "600", *flags],
                            stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True, start_new_session=True)
    grpc_target = re.search(r"gRPC on (\S+)", proc.stdout.readline()).group(1)
    url = re.search(r"listening on (http://\S+)", proc.stdout.readline()).group(1)
    want = int(flags[flags.index("--workers") + 1]) if "--workers" in flags else 1
    while len(httpx.get(url + "/v1/pool", timeout=30).json()["workers"]) < want:
        time.sleep(1)
    return proc, url, grpc_target


def post(url: str, prompt) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=600)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def hop(client: PrefillClient, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    r = client.prefill(prompt)
    return time.perf_counter() - t0 - r.timings["queue_s"] - r.timings["prefill_s"]


def measure(url: str, grpc_target: str) -> dict:
    short = [100 + i for i in range(64)]
    for _ in range(3):
        post(url, short)
    lat = [post(url, short) for _ in range(20)]
    with PrefillClient(grpc_target) as client:
        for _ in range(3):
            hop(client, short)
        hops = [hop(client, short) for _ in range(20)]
    prompts = [[1000 + (k * 131 + j) % 20000 for j in range(1000)] for k in range(16)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda p: post(url, p), prompts))
    wall = time.perf_counter() - t0
    return {"ttft_64_median_s": statistics.median(lat), "ttft_64_all_s": lat,
            "grpc_outside_engine_median_s": statistics.median(hops), "grpc_outside_engine_all_s": hops,
            "load_wall_s": wall, "load_tokens_per_s": 16 * 1000 / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "runs": {}}
    # Ray gives an actor OMP_NUM_THREADS = its num_cpus (--worker-cpus, 1 by default): "workers-1-2cpus"
    # is one worker with the in-process engine's two cores, the like-for-like overhead
    for name, flags in (("in-process", []), ("workers-1", ["--workers", "1"]),
                        ("workers-1-2cpus", ["--workers", "1", "--worker-cpus", "2"]), ("workers-2", ["--workers", "2"])):
        proc, url, grpc_target = serve(flags, pathlib.Path(f"/tmp/pool-bench-{name}.log"))
        try:
            out["runs"][name] = measure(url, grpc_target)
            print(name, {k: v for k, v in out["runs"][name].items() if not k.endswith("_all_s")}, flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    r = out["runs"]
    out["pool_overhead_ms"] = 1000 * (r["workers-1"]["ttft_64_median_s"] - r["in-process"]["ttft_64_median_s"])
    out["pool_hop_ms"] = 1000 * (r["workers-1"]["grpc_outside_engine_median_s"]
                                 - r["in-process"]["grpc_outside_engine_median_s"])
    out["pool_overhead_2cpus_ms"] = 1000 * (r["workers-1-2cpus"]["ttft_64_median_s"]
                                            - r["in-process"]["ttft_64_median_s"])
    out["scaling_2_over_1"] = r["workers-2"]["load_tokens_per_s"] / r["workers-1"]["load_tokens_per_s"]
    keys = ("pool_overhead_ms", "pool_overhead_2cpus_ms", "pool_hop_ms", "scaling_2_over_1")
    print(json.dumps({k: out[k] for k in keys}))
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

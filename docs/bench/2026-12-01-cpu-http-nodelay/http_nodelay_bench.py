"""(Recorded CPU measurement, kept here with its data; until 2026-12-02 it lived in the scripts folder.)
Per-request latency of a JSON POST over keep-alive HTTP, served by uvicorn on a socket from
``prefill_server.serving.server.bind`` (with IPPROTO_TCP: asyncio sets TCP_NODELAY) against the same
socket opened with protocol 0 (before 72a46dd: Nagle held each response's body behind its head until
the client's delayed ACK). A minimal FastAPI app, so only the socket differs.

    .venv/bin/python docs/bench/2026-12-01-cpu-http-nodelay/http_nodelay_bench.py \
        --out docs/bench/2026-12-01-cpu-http-nodelay/http_nodelay_cpu_2026-12-01.json
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request

from prefill_server.serving.server import bind


def app() -> FastAPI:
    a = FastAPI()

    @a.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        return {"id": "x", "choices": [{"text": body.get("prompt", "")[:8]}]}
    return a


def serve(sock: socket.socket):
    srv = uvicorn.Server(uvicorn.Config(app(), log_level="warning", access_log=False))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.01)
    return srv, t


def measure(sock: socket.socket, n: int) -> dict:
    srv, t = serve(sock)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    times = []
    with httpx.Client(timeout=10) as c:
        for i in range(n + 5):
            t0 = time.perf_counter()
            r = c.post(url, json={"prompt": "Hello there", "max_tokens": 1})
            dt = time.perf_counter() - t0
            assert r.status_code == 200
            if i >= 5:
                times.append(dt * 1e3)
    srv.should_exit = True
    t.join(timeout=10)
    sock.close()
    return {"median_ms": statistics.median(times), "p90_ms": sorted(times)[int(0.9 * len(times))], "n": n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--out", default="http_nodelay.json")
    args = ap.parse_args()
    old = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # the socket bind() opened before
    old.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    old.bind(("127.0.0.1", 0))
    res = {"bind_ipproto_tcp": measure(bind("127.0.0.1", 0), args.n), "proto_0_before": measure(old, args.n),
           "date": time.strftime("%Y-%m-%d"), "host": "2-core CPU box, loopback"}
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

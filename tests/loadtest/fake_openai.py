"""A tiny OpenAI-compatible server for the load generator's tests: completions and chat, streamed
(SSE) or not, with ``prefill_server:*`` metrics, and misbehaviour asked for in the prompt:

    [[status=429]]      that status with an OpenAI error body (429 and 503 carry Retry-After: 3)
    [[delay=0.2]]       seconds before the first token
    [[itl=0.01]]        seconds between tokens (default: the server's itl_s)
    [[error-after=2]]   stream 2 tokens, then an error event ``data: {"error": ...}`` and [DONE]
    [[drop-after=2]]    stream 2 tokens, then drop the connection
    [[no-done]]         end the stream without [DONE]
    [[hang]]            never answer

A prompt holding "the secret number of the X vault is N" is answered with N (the needle check).
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_MARK = re.compile(r"\[\[([a-z-]+)(?:=([0-9.]+))?\]\]")
_NEEDLE = re.compile(r"secret number of the \w+ vault is (\d+)")


class FakeOpenAI:
    def __init__(self, *, itl_s: float = 0.002, blocks_per_request: int = 4, blocks_release_delay_s: float = 0.0,
                 count_delay_s: float = 0.0, after_done_s: float = 0.0):
        self.itl_s, self.blocks_per_request = itl_s, blocks_per_request
        self.blocks_release_delay_s = blocks_release_delay_s
        self.count_delay_s = count_delay_s  # outcomes counted this late, as a real server's after its [DONE]
        self.after_done_s = after_done_s  # work after [DONE] before the body ends (a real gateway closes its
        #                                   decode stream): a client that hangs up at [DONE] cancels it
        self.in_flight = self.max_in_flight = self.received = 0
        self.arrivals: list[float] = []  # time.perf_counter() of each request's arrival
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []  # each request's Authorization header
        reg = self.registry = CollectorRegistry()
        p = "prefill_server:"
        self.h = {n: Histogram(p + n, n, registry=reg) for n in
                  ("queue_seconds", "prefill_seconds", "time_to_first_token_seconds", "kv_transfer_seconds")}
        self.outcomes = Counter(p + "requests_total", "outcomes", ["outcome"], registry=reg)
        self.blocks = Gauge(p + "kv_blocks_in_use", "blocks", registry=reg)
        Gauge(p + "kv_blocks_total", "blocks", registry=reg).set(1000)
        self.app = self._app()

    # ---- behaviour ----
    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.registry), media_type="text/plain")

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.auth.append(request.headers.get("authorization"))
            return await self._answer(body, body.get("prompt") or "", chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.auth.append(request.headers.get("authorization"))
            return await self._answer(body, "\n".join(m.get("content") or "" for m in body["messages"]), chat=True)

        return app

    async def _answer(self, body: dict, prompt: str, chat: bool):
        self.received += 1
        self.arrivals.append(time.perf_counter())
        self.bodies.append(body)
        marks = {m.group(1): (float(m.group(2)) if m.group(2) else True) for m in _MARK.finditer(prompt)}
        if "status" in marks:
            code = int(marks["status"])
            self.outcomes.labels(f"http{code}").inc()
            headers = {"Retry-After": "3"} if code in (429, 503) else None
            return JSONResponse({"error": {"message": f"fake {code}", "type": "Fake", "code": code}},
                                status_code=code, headers=headers)
        n = int(body.get("max_tokens") or 4)
        needle = _NEEDLE.search(prompt)
        words = [needle.group(1)] + [" ok"] * (n - 1) if needle else [f" t{i}" for i in range(n)]
        delay = float(marks.get("delay", 0.0))
        itl = float(marks.get("itl", self.itl_s))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.blocks.inc(self.blocks_per_request)
        self.h["queue_seconds"].observe(0.001)
        self.h["prefill_seconds"].observe(delay)
        self.h["time_to_first_token_seconds"].observe(delay + 0.002)
        if not body.get("stream"):
            try:
                if "hang" in marks:
                    await asyncio.sleep(3600)
                await asyncio.sleep(delay + itl * (n - 1))
            finally:
                self._end("ok")
            usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": n, "total_tokens": len(prompt) // 4 + n}
            text = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            return JSONResponse({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                 "choices": [choice], "usage": usage})
        return StreamingResponse(self._events(body, prompt, words, marks, delay, itl, chat),
                                 media_type="text/event-stream")

    def _end(self, outcome: str) -> None:
        self.in_flight -= 1
        if self.count_delay_s:
            asyncio.get_running_loop().call_later(self.count_delay_s, self.outcomes.labels(outcome).inc)
        else:
            self.outcomes.labels(outcome).inc()
        self.h["kv_transfer_seconds"].observe(0.003)
        if self.blocks_release_delay_s:
            asyncio.get_running_loop().call_later(self.blocks_release_delay_s, self.blocks.dec,
                                                  self.blocks_per_request)
        else:
            self.blocks.dec(self.blocks_per_request)

    async def _events(self, body, prompt, words, marks, delay, itl, chat):
        outcome = "cancelled"
        try:
            if "hang" in marks:
                await asyncio.sleep(3600)
            await asyncio.sleep(delay)
            if chat:
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i, w in enumerate(words):
                if i:
                    await asyncio.sleep(itl)
                if "error-after" in marks and i == int(marks["error-after"]):
                    yield _sse({"error": {"message": "fake mid-stream failure", "type": "Fake", "code": 502}})
                    yield b"data: [DONE]\n\n"
                    outcome = "DecodeStreamBroken"
                    return
                if "drop-after" in marks and i == int(marks["drop-after"]):
                    outcome = "dropped"
                    raise ConnectionAbortedError("fake drop")
                choice = {"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w}
                yield _sse({"choices": [choice]})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _sse({"choices": [], "usage": {"prompt_tokens": len(prompt) // 4,
                                                     "completion_tokens": len(words)}})
            if "no-done" not in marks:
                yield b"data: [DONE]\n\n"
            await asyncio.sleep(self.after_done_s)
            outcome = "ok"
        finally:
            self._end(outcome)


def _sse(ev: dict) -> bytes:
    return b"data: " + json.dumps(ev).encode() + b"\n\n"


class Served:
    """``with Served(FakeOpenAI()) as s: s.url``: uvicorn on a thread, on a free port."""

    def __init__(self, fake: FakeOpenAI):
        self.fake = fake
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __enter__(self) -> "Served":
        self.server = uvicorn.Server(uvicorn.Config(self.fake.app, log_level="critical", access_log=False))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def req(i: int, text: str = "hello", **kw):
    """A request of the test workload (its text may carry [[markers]])."""
    from loadtest.workloads import Request

    return Request(index=i, workload="test", messages=[{"role": "user", "content": text}], prompt_tokens=2, **kw)

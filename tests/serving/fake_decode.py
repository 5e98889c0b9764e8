"""A stand-in for a vLLM decode's HTTP API, for gateway tests that need a decode to misbehave in
ways a real one does only when it crashes (a stream cut mid-answer, a dead /health) or to show
what reached it. Protocol details follow vLLM 0.32's OpenAI server; the real decode is the e2e
tests' (tests/e2e)."""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefill_server.serving.background import BackgroundServer
from prefill_server.serving.request_guard import RequestGuard


class FakeDecode:
    def __init__(self, *, max_model_len: int = 4096, model: str = "fake", tokens: int = 3,
                 break_after: int | None = None, delay_s: float = 0.0, after_done_s: float = 0.0,
                 miscount: int = 0, token_s: float = 0.0):
        self.requests: list[dict] = []  # bodies received on /v1/*
        self.model = model
        self.healthy = True
        self.break_after = break_after  # streams: cut the connection after this many events
        self.delay_s, self.tokens = delay_s, tokens
        self.after_done_s = after_done_s  # streams: the body ends this long after [DONE]
        self.miscount = miscount  # added to a prompt's token count (a decode whose tokenizer differs)
        self.token_s = token_s  # streams: the time between events (a slow decode)
        self.fail_status: int | None = None  # answer every request so (vLLM's 500: it could not read the KV)
        self.cancelled = 0  # requests whose client (the gateway) went away before the answer
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.get("/version")
        async def version():
            return {"version": "0.32.0"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": model, "root": f"/models/{model}",
                                                "max_model_len": max_model_len}]}

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete(request: Request):
            body = await request.json()
            self.requests.append(body)
            try:
                await asyncio.sleep(self.delay_s)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            if self.fail_status is not None:
                return JSONResponse({"error": {"message": "Internal server error", "type": "InternalServerError",
                                               "param": None, "code": self.fail_status}}, status_code=self.fail_status)
            if body.get("stream"):
                return StreamingResponse(self._events(), media_type="text/event-stream")
            n = (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 5) + self.miscount
            return {"id": "cmpl-x", "object": "text_completion", "created": int(time.time()), "model": model,
                    "choices": [{"index": 0, "text": " ok" * self.tokens, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": n, "completion_tokens": self.tokens,
                              "total_tokens": n + self.tokens}}

        # vLLM aborts a request whose client disconnects: so does this decode, the same way ours does
        self.server = BackgroundServer(RequestGuard(app, 2**30))
        self.url = self.server.url

    async def _events(self):
        for i in range(self.tokens):
            if self.break_after is not None and i == self.break_after:
                raise RuntimeError("decode died")  # uvicorn drops the connection mid-body
            ev = {"id": "cmpl-x", "object": "text_completion", "model": self.model,
                  "choices": [{"index": 0, "text": " ok", "finish_reason": None}]}
            yield f"data: {json.dumps(ev, separators=(',', ':'))}\n\n".encode()  # (compact, as vLLM writes it)
            await asyncio.sleep(self.token_s)
        yield b"data: [DONE]\n\n"
        await asyncio.sleep(self.after_done_s)

    def __enter__(self) -> FakeDecode:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

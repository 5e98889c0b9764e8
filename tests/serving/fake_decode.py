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

FINGERPRINT = "vllm-0.32.0-fake0000"  # (vLLM's default form: vllm-<version>-<config hash>)


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
            n = self._prompt_tokens(body)
            if body.get("stream"):
                return StreamingResponse(self._events(request.url.path.endswith("chat/completions"), body, n),
                                         media_type="text/event-stream")
            return {"id": "cmpl-x", "object": "text_completion", "created": int(time.time()), "model": model,
                    "choices": [{"index": 0, "text": " ok" * self.tokens, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": n, "completion_tokens": self.tokens,
                              "total_tokens": n + self.tokens}}

        # vLLM aborts a request whose client disconnects: so does this decode, the same way ours does
        self.server = BackgroundServer(RequestGuard(app, 2**30))
        self.url = self.server.url

    def _prompt_tokens(self, body: dict) -> int:
        """The prompt as this decode counts it: token ids as sent, else (a chat, a text) the count
        the prefill's kv_transfer_params name (transfer mode local: ``num_tokens``), plus ``miscount``."""
        if isinstance(body.get("prompt"), list):
            n = len(body["prompt"])
        else:
            n = (body.get("kv_transfer_params") or {}).get("num_tokens", 5)
        return n + self.miscount

    async def _events(self, chat: bool, body: dict, n: int):
        """The stream vLLM 0.32 sends (chat_completion/serving.py, completion/serving.py; compact JSON,
        unset fields left out): chat's role chunk first; ``stream_options.include_usage`` adds a last
        chunk with ``choices: []``, the usage and system_fingerprint (else the finishing chunk carries
        the fingerprint); with ``continuous_usage_stats`` too every chunk carries the usage so far."""
        so = body.get("stream_options") or {}
        include = bool(so.get("include_usage"))
        continuous = include and bool(so.get("continuous_usage_stats"))
        head = {"id": "chatcmpl-x" if chat else "cmpl-x", "object": "chat.completion.chunk" if chat
                else "text_completion", "created": int(time.time()), "model": self.model}

        def usage(k: int) -> dict:
            u = {"prompt_tokens": n, "total_tokens": n + k, "completion_tokens": k}
            return u | {"completion_tokens_details": None} if chat else u

        def event(ev: dict) -> bytes:
            return f"data: {json.dumps(ev, separators=(',', ':'))}\n\n".encode()
        if chat:
            yield event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}],
                         **({"usage": usage(0)} if continuous else {}), "prompt_token_ids": None, "prompt_text": None})
        for i in range(self.tokens):
            if self.break_after is not None and i == self.break_after:
                raise RuntimeError("decode died")  # uvicorn drops the connection mid-body
            last = i == self.tokens - 1
            finish = {"finish_reason": "length", "stop_reason": None} if last else {"finish_reason": None}
            choice = ({"index": 0, "delta": {"content": " ok"}, "logprobs": None, **finish, "token_ids": None} if chat
                      else {"index": 0, "text": " ok", "logprobs": None, **finish, "stop_reason": None,
                            "prompt_token_ids": None, "token_ids": None})
            ev = {**head, "choices": [choice]}
            if last and not include:
                ev["system_fingerprint"] = FINGERPRINT
            if continuous:
                ev["usage"] = usage(i + 1)
            yield event(ev)
            await asyncio.sleep(self.token_s)
        if include:
            u = {"prompt_tokens": n, "total_tokens": n + self.tokens, "completion_tokens": self.tokens}
            yield event({**head, "choices": [], "usage": u, "system_fingerprint": FINGERPRINT})
        yield b"data: [DONE]\n\n"
        await asyncio.sleep(self.after_done_s)

    def __enter__(self) -> FakeDecode:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

"""A minimal PD proxy that does what vLLM's own ``toy_proxy_server.py``
(tests/v1/kv_connector/nixl_integration) does, step by step as vLLM documents it:

1. copy the client's body for the prefill, with ``kv_transfer_params`` = ``{"do_remote_decode": true,
   "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host":
   null, "remote_port": null}``, ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens:
   1`` when present), without ``stream_options``;
2. POST it to the prefill with ``X-Request-Id`` (and the API key as a bearer token), failing on an
   error status;
3. put the answer's ``kv_transfer_params`` into the client's own body;
4. POST that to the decode with the same headers and stream its answer back to the client.
"""
from __future__ import annotations

import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from prefill_server.serving.background import BackgroundServer


def toy_proxy(prefill_url: str, decode_url: str, api_key: str = "") -> BackgroundServer:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=None)

    async def handle(path: str, request: Request):
        req = await request.json()
        headers = {"X-Request-Id": str(uuid.uuid4())} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        pre = dict(req, stream=False, max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                       "remote_block_ids": None, "remote_host": None, "remote_port": None})
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        pre.pop("stream_options", None)
        r = await client.post(prefill_url + path, json=pre, headers=headers)
        r.raise_for_status()
        if params := r.json().get("kv_transfer_params"):
            req["kv_transfer_params"] = params

        async def relay():
            async with client.stream("POST", decode_url + path, json=req, headers=headers) as resp:
                async for chunk in resp.aiter_bytes():
                    yield chunk
        return StreamingResponse(relay(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle("/v1/chat/completions", request)

    return BackgroundServer(app)

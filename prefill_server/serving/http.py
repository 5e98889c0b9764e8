"""OpenAI-compatible HTTP gateway: prefill here, then the decode answers with our KV.

POST /v1/completions and /v1/chat/completions (stream and non-stream), GET /v1/models, /health,
/metrics. Errors are OpenAI-shaped JSON with a 4xx/5xx status and a message that says what to change.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefill_server.engine.types import PrefillResult, SamplingParams
from prefill_server.errors import InvalidRequest, PrefillError, Unauthenticated
from prefill_server.serving import openai_schema as schema
from prefill_server.serving.proxy import DecodeClient
from prefill_server.serving.service import PrefillService

log = logging.getLogger(__name__)


def _error(status: int, message: str, etype: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "param": param, "code": status}},
                        status_code=status)


def create_app(service: PrefillService, decode: DecodeClient | None, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="prefill-server", docs_url=None, redoc_url=None)
    metrics = service.engine.metrics

    @app.exception_handler(PrefillError)
    async def _prefill_error(_req: Request, e: PrefillError):
        return _error(e.http_status, e.message, type(e).__name__, e.field)

    @app.exception_handler(Exception)
    async def _internal(_req: Request, e: Exception):
        log.exception("internal error")
        return _error(500, f"internal error: {type(e).__name__}", "InternalError")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                e = Unauthenticated("missing or wrong API key: send 'Authorization: Bearer <key>'")
                return _error(e.http_status, e.message, "Unauthenticated")
        return await call_next(request)

    async def read_json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"the body is not valid JSON ({e}); send a JSON object") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        return body

    def sampling_of(b: schema._Body) -> SamplingParams:
        return SamplingParams(temperature=b.temperature if b.temperature is not None else 1.0,
                              top_p=b.top_p if b.top_p is not None else 1.0,
                              top_k=b.top_k if b.top_k is not None else -1, seed=b.seed)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        i = service.info
        return {"object": "list", "data": [{"id": i.served_name, "object": "model", "owned_by": "prefill-server",
                                            "root": i.path, "max_model_len": i.max_model_len}]}

    @app.get("/metrics")
    async def prom():
        service.engine.refresh_metrics()
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await read_json(request)
        body = schema.parse(schema.CompletionBody, raw)
        service.check_model(body.model)
        token_ids = service.encode_prompt(schema.single_prompt(body.prompt))
        out = dict(raw, prompt=token_ids)  # the decode gets exactly the tokens we prefilled
        return await run(request, "/v1/completions", out, token_ids, sampling_of(body), body.stream)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await read_json(request)
        body = schema.parse(schema.ChatBody, raw)
        service.check_model(body.model)
        kwargs = {"tools": raw["tools"]} if raw.get("tools") else {}
        token_ids = service.encode_chat(schema.chat_messages(body), **kwargs)
        return await run(request, "/v1/chat/completions", dict(raw), token_ids, sampling_of(body), body.stream)

    async def run(request: Request, path: str, out: dict, token_ids: list[int], sampling: SamplingParams,
                  stream: bool) -> Response:
        t0 = time.monotonic()
        if service.transfer_mode == "connector":
            return await run_push(path, out, token_ids, sampling, stream, t0)
        result = await service.prefill(token_ids, sampling)
        if decode is None:  # transfer mode "local": answer with the first token only
            service.release(result.request_id)
            return JSONResponse(_local_answer(service, path, result))
        return await to_decode(path, out, result.request_id, result.kv_transfer_params, len(token_ids),
                               stream, t0)

    async def run_push(path: str, out: dict, token_ids: list[int], sampling: SamplingParams, stream: bool,
                       t0: float) -> Response:
        """Connector mode: decode and prefill at once; the decode's connector registers its blocks
        with the prefill, which WRITEs each layer as it is computed; the decode answers."""
        rid, params, prefill = service.start_push(token_ids, sampling)
        prefill.add_done_callback(_consume)
        return await to_decode(path, out, rid, params, len(token_ids), stream, t0, prefill)

    async def to_decode(path: str, out: dict, rid: str, params: dict, n_tokens: int, stream: bool,
                        t0: float, prefill: asyncio.Future | None = None) -> Response:
        """Send the request to the decode with kv_transfer_params and relay its answer. Whenever
        the decode will not use our KV (unreachable, refused, client gone), free it at once."""
        out["kv_transfer_params"] = params
        out.setdefault("model", service.info.served_name)
        try:
            if stream:
                resp = await decode.open_stream(path, out)
                if resp.status_code >= 400:
                    content = await resp.aread()
                    await resp.aclose()
                    service.release(rid)
                    return Response(content, resp.status_code, media_type="application/json")
                metrics.e2e_time.observe(time.monotonic() - t0)
                return StreamingResponse(decode.relay(resp), media_type="text/event-stream")
            resp = await decode.post(path, out)
        except BaseException:  # unreachable decode, client gone
            service.release(rid)
            metrics.kv_failed.inc()
            raise
        if resp.status_code >= 400:  # the decode refused or failed: it will not use our KV
            service.release(rid)
            metrics.kv_failed.inc()
            if prefill is not None:  # connector mode: the prefill's reason says more than a 500
                await asyncio.wait([prefill], timeout=2.0)
                if prefill.done() and not prefill.cancelled() and (e := prefill.exception()) is not None:
                    if isinstance(e, PrefillError):
                        raise e
                    raise PrefillError(f"the prefill failed ({type(e).__name__}: {e}); the decode "
                                       "could not use its KV") from e
        metrics.e2e_time.observe(time.monotonic() - t0)
        _check_prompt_tokens(resp, n_tokens, rid)
        return Response(resp.content, resp.status_code, media_type="application/json")

    return app


def _consume(fut) -> None:
    """Retrieve a background prefill's exception so asyncio does not log it as unhandled."""
    if not fut.cancelled() and fut.exception() is not None:
        log.info("streamed prefill ended with %s", type(fut.exception()).__name__)


def _check_prompt_tokens(resp, n: int, rid: str) -> None:
    """The decode must have used exactly our tokens; a mismatch means tokenizers disagree."""
    try:
        used = resp.json().get("usage", {}).get("prompt_tokens")
    except Exception:
        return
    if used is not None and used != n:
        log.error("request %s: decode counted %s prompt tokens, the prefill %d (tokenizer mismatch?)",
                  rid, used, n)


def _local_answer(service: PrefillService, path: str, r: PrefillResult) -> dict:
    text = service.tokenizer.decode([r.first_token_id])
    usage = {"prompt_tokens": r.num_prompt_tokens, "completion_tokens": 1,
             "total_tokens": r.num_prompt_tokens + 1}
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": service.info.served_name,
            "usage": usage}
    if path.endswith("chat/completions"):
        return {**base, "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}]}
    return {**base, "object": "text_completion", "choices": [
        {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}]}

"""OpenAI-compatible HTTP gateway: prefill here, then the decode answers with our KV.

POST /v1/completions and /v1/chat/completions (stream and non-stream), GET /v1/models, /health,
/metrics. Errors are OpenAI-shaped JSON with a 4xx/5xx status and a message that says what to change.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from itertools import compress, repeat
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from prefill_server.engine.types import PrefillResult, SamplingParams
from prefill_server.errors import InvalidRequest, PrefillError, Unauthenticated
from prefill_server.serving import first_token as ft
from prefill_server.serving import openai_schema as schema
from prefill_server.serving.proxy import DecodeClient
from prefill_server.serving.service import PrefillService

log = logging.getLogger(__name__)


def _error(status: int, message: str, etype: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "param": param, "code": status}},
                        status_code=status)


class UnsupportedMediaType(InvalidRequest):
    http_status = 415


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}
MAX_JSON_DEPTH = 128  # far more than any OpenAI body needs, far from Python's recursion limit
_TEXT_OR_NESTED = {str, list, dict}.__contains__


def _parse_json(raw: bytes) -> dict:
    """The body as a JSON object, refusing what Python's json accepts but JSON does not (NaN,
    Infinity, numbers out of a double's range, unpaired UTF-16 surrogates) and deep nesting: the
    body is forwarded to the decode, and these would fail there, in the tokenizer or in our parser."""
    try:
        body = json.loads(raw, parse_constant=_non_finite, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep() from None
    except InvalidRequest:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the body is not valid JSON ({e}); send a JSON object") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits())
        raise InvalidRequest("the body holds an integer too long to parse; send smaller numbers") from None
    stack = [(body, 0)]
    while stack:  # every string and container, iteratively; numbers are skipped at C speed
        x, depth = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequest(f"the body holds an unpaired UTF-16 surrogate ({x[e.start]!a}); send "
                                     "valid Unicode text") from None
        elif isinstance(x, (list, dict)):
            if depth == MAX_JSON_DEPTH:
                raise _too_deep()
            items = x if isinstance(x, list) else [*x, *x.values()]
            stack.extend(zip(compress(items, map(_TEXT_OR_NESTED, map(type, items))), repeat(depth + 1)))
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, not {_JSON_TYPES[type(body)]}")
    return body


def _too_deep() -> InvalidRequest:
    return InvalidRequest(f"the body is nested more than {MAX_JSON_DEPTH} levels deep; send a flatter JSON object")


def _non_finite(name: str):
    raise InvalidRequest(f"the body is not valid JSON: {name} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise InvalidRequest(f"the number {text[:40]} is out of the range of a double; send a smaller number")
    return x


def create_app(service: PrefillService, decode: DecodeClient | None, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="prefill-server", docs_url=None, redoc_url=None)
    metrics = service.engine.metrics

    @app.exception_handler(PrefillError)
    async def _prefill_error(_req: Request, e: PrefillError):
        return _error(e.http_status, e.message, type(e).__name__, e.field)

    @app.exception_handler(HTTPException)  # no such path, or a wrong method: OpenAI-shaped too
    async def _http_error(req: Request, e: HTTPException):
        headers = e.headers or {}
        message = f"{e.detail}: {req.method} {req.url.path}"
        if e.status_code == 404:
            message += ("; this server serves POST /v1/completions, POST /v1/chat/completions, "
                        "GET /v1/models, GET /health and GET /metrics")
        elif allow := {k.lower(): v for k, v in headers.items()}.get("allow"):
            message += f"; use {allow}"
        resp = _error(e.status_code, message, str(e.detail).title().replace(" ", ""))
        resp.headers.update(headers)
        return resp

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
        media = (request.headers.get("content-type") or "application/json").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise UnsupportedMediaType(f"Content-Type {media!r} is not supported: send the body as JSON "
                                       "with 'Content-Type: application/json'", field="content-type")
        return _parse_json(await request.body())

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
        return await run(request, "/v1/completions", out, token_ids, sampling_of(body), body.stream,
                         first_plan("completion", raw))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await read_json(request)
        body = schema.parse(schema.ChatBody, raw)
        service.check_model(body.model)
        kwargs = {"tools": body.tools} if body.tools else {}
        token_ids = service.encode_chat(schema.chat_messages(body), **kwargs)
        return await run(request, "/v1/chat/completions", dict(raw), token_ids, sampling_of(body), body.stream,
                         first_plan("chat", raw))

    def first_plan(kind: str, raw: dict) -> ft.Plan | None:
        if service.first_token != "prefill" or service.transfer_mode not in ("nixl-compat", "connector"):
            return None
        return ft.plan(kind, raw)

    async def run(request: Request, path: str, out: dict, token_ids: list[int], sampling: SamplingParams,
                  stream: bool, plan: ft.Plan | None = None) -> Response:
        t0 = time.monotonic()
        pull_later = service.transfer_mode == "connector"  # computed first: the decode pulls
        if pull_later and not (plan and service.fits_whole(len(token_ids))):
            return await run_push(path, out, token_ids, sampling, stream, t0)
        # a decode continuing from prompt + [t1] allocates KV for t1's position too: lease room for it
        room = 1 if plan and not pull_later else 0
        result = await service.prefill(token_ids, sampling, num_logprobs=plan.num_logprobs if plan else None,
                                       pull_later=pull_later, room_tokens=room)
        if decode is None:  # transfer mode "local": answer with the first token only
            service.release(result.request_id)
            return JSONResponse(_local_answer(service, path, result))
        first = plan and ft.first_token(plan, service.tokenizer, service.eos_token_ids, token_ids,
                                        result.first_token_id, result.first_logprobs, service.info.max_model_len)
        metrics.first_token.labels("prefill" if first else "decode").inc()
        params = service.params_for_prompt(result.kv_transfer_params, len(token_ids) + (1 if first else 0))
        if first:  # the decode continues from prompt + [t1] (serving/first_token.py)
            path, out = "/v1/completions", first.decode_body(token_ids, service.info.served_name, params)
        return await to_decode(path, out, result.request_id, params, len(token_ids),
                               stream, t0, first=first, release_after=pull_later)

    async def run_push(path: str, out: dict, token_ids: list[int], sampling: SamplingParams, stream: bool,
                       t0: float) -> Response:
        """Connector mode: decode and prefill at once; the decode's connector registers its blocks
        with the prefill, which WRITEs each layer as it is computed; the decode answers."""
        rid, params, prefill = service.start_push(token_ids, sampling)
        prefill.add_done_callback(_consume)
        return await to_decode(path, out, rid, params, len(token_ids), stream, t0, prefill)

    async def to_decode(path: str, out: dict, rid: str, params: dict, n_tokens: int, stream: bool,
                        t0: float, prefill: asyncio.Future | None = None,
                        first: ft.FirstToken | None = None, release_after: bool = False) -> Response:
        """Send the request to the decode with kv_transfer_params and relay its answer (with
        ``first``: t1 first, then the decode's continuation, rewritten). Whenever the decode will not
        use our KV (unreachable, refused, client gone), free it at once. release_after: also once
        it has answered (a lease the decode did not read: e.g. its own prefix cache had the prompt)."""
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
                relay = (_relay_first(first.stream_start(), resp, service.info.served_name) if first
                         else decode.relay(resp))
                if release_after:
                    relay = _then(relay, lambda: service.release(rid))
                return StreamingResponse(relay, media_type="text/event-stream")
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
        if release_after:
            service.release(rid)
        if first and resp.status_code < 400:
            _check_prompt_tokens(resp, n_tokens + 1, rid)
            return JSONResponse(first.merge(resp.json()))
        _check_prompt_tokens(resp, n_tokens, rid)
        return Response(resp.content, resp.status_code, media_type="application/json")

    return app


async def _relay_first(state: ft.StreamState, resp, model: str) -> AsyncIterator[bytes]:
    """t1's events first, then the decode's, rewritten (serving/first_token.py)."""
    try:
        yield state.first(model)
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                yield state.event(line[5:].strip())
    finally:
        await resp.aclose()


async def _then(gen: AsyncIterator[bytes], done) -> AsyncIterator[bytes]:
    try:
        async for chunk in gen:
            yield chunk
    finally:
        done()


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

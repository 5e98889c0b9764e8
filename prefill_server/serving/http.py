"""OpenAI-compatible HTTP front end: HTTP to and from the gateway's calls (``gateway.py`` holds the
prefill-then-decode policy), nothing more.

POST /v1/completions and /v1/chat/completions (stream and non-stream), GET /v1/models, /metrics,
/health (readiness: 503 while the engine loop is dead or no decode is up; 200 with "degraded" while
some decodes are down) and /livez (liveness).
Errors are OpenAI-shaped JSON with a 4xx/5xx status and a message that says what to change; a 429 or
503 that may pass carries Retry-After. Bodies are limited (413) and a client that hangs up cancels
its request (``request_guard.py``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from itertools import compress, repeat

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from prefill_server.errors import InvalidRequest, PrefillError
from prefill_server.serving import sglang_prefill, vllm_metrics
from prefill_server.serving.auth import ApiKeys
from prefill_server.serving.decode_client import DecodeClient
from prefill_server.serving.decodes import DecodeSet
from prefill_server.serving.gateway import Answer, Gateway
from prefill_server.serving.request_guard import RequestGuard
from prefill_server.serving.service import PrefillService

log = logging.getLogger(__name__)


DEFAULT_MAX_BODY_BYTES = 64 * 2**20  # a 1M-token prompt as token ids is ~7 MB of JSON
_PARSE_OFF_LOOP_BYTES = 2**20  # larger bodies are parsed in a thread: the loop keeps answering /health


def _error(status: int, message: str, etype: str, param: str | None = None,
           retry_after_s: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s else None
    return JSONResponse({"error": {"message": message, "type": etype, "param": param, "code": status}},
                        status_code=status, headers=headers)


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


_MAX_TAG_CHARS = 256


def _request_tag(request: Request) -> str | None:
    """The caller's ``X-Request-Id`` (vllm-router's are ~100 characters), printable and bounded,
    for our logs; never used as our own request id."""
    tag = request.headers.get("x-request-id")
    if not tag:
        return None
    return "".join(c if c.isprintable() else "?" for c in tag[:_MAX_TAG_CHARS])


def create_app(service: PrefillService, decodes: DecodeSet | DecodeClient | None, api_keys: ApiKeys | None = None,
               *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, decode_health_interval_s: float = 5.0,
               drain: asyncio.Event | None = None):
    """The ASGI app. ``decodes``: the decodes (one client is a set of one), None in transfer mode
    local; their health checks run while the app does. ``drain``: set once the server is shutting
    down (readiness then fails, so load balancers stop sending)."""
    if isinstance(decodes, DecodeClient):
        decodes = DecodeSet.of(decodes, decode_health_interval_s, service.metrics)
    gateway = Gateway(service, decodes)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if decodes is not None:
            decodes.start()
        try:
            yield
        finally:
            if decodes is not None:
                await decodes.stop()

    app = FastAPI(title="prefill-server", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway, app.state.decodes = gateway, decodes

    @app.exception_handler(PrefillError)
    async def _prefill_error(_req: Request, e: PrefillError):
        return _error(e.http_status, e.message, type(e).__name__, e.field, e.retry_after_s)

    @app.exception_handler(HTTPException)  # no such path, or a wrong method: OpenAI-shaped too
    async def _http_error(req: Request, e: HTTPException):
        headers = e.headers or {}
        message = f"{e.detail}: {req.method} {req.url.path}"
        if e.status_code == 404:
            message += ("; this server serves POST /v1/completions, POST /v1/chat/completions, "
                        "GET /v1/models, GET /v1/pool, POST /reset_prefix_cache, GET /health, GET /livez "
                        "and GET /metrics")
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
        if api_keys is not None and api_keys.protects(request.url.path):
            if (e := api_keys.check(request.headers.get("authorization"))) is not None:
                return _error(e.http_status, e.message, "Unauthenticated")
        return await call_next(request)

    async def read_json(request: Request) -> dict:
        media = (request.headers.get("content-type") or "application/json").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise UnsupportedMediaType(f"Content-Type {media!r} is not supported: send the body as JSON "
                                       "with 'Content-Type: application/json'", field="content-type")
        raw = await request.body()
        if len(raw) > _PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(_parse_json, raw)
        return _parse_json(raw)

    def reply(answer, tag: str | None = None) -> Response:
        headers = {"X-Request-Id": tag} if tag else None  # echoed, as vLLM does
        if not isinstance(answer, Answer):
            return StreamingResponse(answer.events, media_type="text/event-stream", headers=headers)
        if isinstance(answer.body, dict):
            return JSONResponse(answer.body, status_code=answer.status, headers=headers)
        return Response(answer.body, answer.status, media_type="application/json", headers=headers)

    @app.get("/livez")
    async def livez():
        """Liveness: the process answers and its engine loop runs (restart it otherwise)."""
        if not service.worker.alive():
            return JSONResponse({"status": "dead", "reasons": ["the engine loop has stopped"]}, status_code=503)
        return {"status": "ok"}

    @app.get("/health")
    async def ready():
        """Readiness: the engine loop runs, the model is loaded and the decode answers."""
        reasons = service.worker.not_ready()
        if drain is not None and drain.is_set():
            reasons.append("the server is shutting down")
        down = decodes.down_reasons() if decodes is not None else []
        if decodes is not None and not decodes.any_up:
            reasons += down
        if reasons:
            return JSONResponse({"status": "unavailable", "reasons": reasons}, status_code=503)
        return {"status": "ok", "degraded": down} if down else {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        i = service.info
        return {"object": "list", "data": [{"id": i.served_name, "object": "model", "owned_by": "prefill-server",
                                            "root": i.path, "max_model_len": i.max_model_len}]}

    @app.get("/v1/pool")
    async def pool():
        """The prefill workers and their load (one, this process, without --workers)."""
        return await asyncio.to_thread(service.worker.pool_status)

    @app.get("/metrics")
    async def prom():  # (a pool asks each worker: off the event loop)
        def render() -> bytes:
            return service.worker.render_metrics() + vllm_metrics.render(service.info, service.worker.load())
        return Response(await asyncio.to_thread(render), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        """vLLM's admin call: forget every cached KV block (a pool: on every worker). Needs the API
        key when one is set (it is outside /v1/)."""
        if api_keys is not None and (e := api_keys.check(request.headers.get("authorization"))) is not None:
            return _error(e.http_status, e.message, "Unauthenticated")
        freed = await asyncio.to_thread(service.worker.reset_prefix_cache)
        return {"status": "ok", "blocks_freed": freed}

    if (bootstrap_port := service.backend.bootstrap_port) is not None:
        # SGLang decodes: what sglang-router asks of its prefill workers (serving/sglang_prefill.py)
        @app.get("/server_info")
        @app.get("/get_server_info")
        async def server_info():
            return sglang_prefill.server_info(service.info, service.backend.page_size_in_use, bootstrap_port)

        @app.get("/model_info")
        @app.get("/get_model_info")
        async def model_info():
            return await asyncio.to_thread(sglang_prefill.model_info, service.info)

        @app.post("/generate")
        async def generate(request: Request):
            tag = _request_tag(request)
            return reply(await gateway.generate(await read_json(request), tag), tag)

    @app.post("/v1/completions")
    async def completions(request: Request):
        tag = _request_tag(request)
        return reply(await gateway.completion(await read_json(request), tag), tag)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        tag = _request_tag(request)
        return reply(await gateway.chat(await read_json(request), tag), tag)

    return RequestGuard(app, max_body_bytes)

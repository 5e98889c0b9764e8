"""One request, over HTTP (OpenAI completions or chat, streamed or not) or gRPC (prefill only), with
its timings and how it ended. The caller passes a record (a dict) that is filled in as the request
goes, so a request cancelled midway (a client abort) keeps what it had measured.

``status`` is ``ok`` or the error's kind:

- ``http_429`` (``retry_after_s`` from its Retry-After), ``http_4xx``, ``http_5xx`` (``http_status``
  has the code; ``error`` the server's message);
- ``stream_error``: an error event ``data: {"error": ...}`` in a stream (``error_code`` is its code);
- ``stream_incomplete``: a stream that ended without ``[DONE]`` and without an error event;
- ``connection``: refused (``refused`` true: nothing reached the server), reset, or the connection
  dropped (mid-stream included);
- ``timeout``: the client gave up (``--request-timeout``);
- ``aborted``: cancelled on purpose by the load generator (``--abort-share``);
- ``grpc_<CODE>``: a gRPC call that failed (e.g. ``grpc_RESOURCE_EXHAUSTED``).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from loadtest.workloads import Request

OK = "ok"
# refused, reset, dropped midway (ServerDisconnectedError, ClientPayloadError), ...
_CONNECTION = (aiohttp.ClientError, OSError)


@dataclass
class Target:
    """Where and how requests go."""

    label: str
    url: str  # the server's base URL (without /v1)
    model: str | None = None
    api: str = "completions"  # or "chat"
    stream: bool = True
    api_key: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    ignore_eos: bool = False
    include_usage: bool = True
    timeout_s: float = 600.0
    retries: int = 0  # retry a 429/503 after its Retry-After, this many times
    retry_max_wait_s: float = 60.0
    extra_body: dict = field(default_factory=dict)
    grpc: str | None = None  # host:port: prefill-only requests through the gRPC API instead

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def body_of(t: Target, req: Request) -> tuple[str, dict]:
    body = {"model": t.model, "max_tokens": req.max_tokens or t.max_tokens, "temperature": float(t.temperature),
            "stream": t.stream}
    if t.stream and t.include_usage:
        body["stream_options"] = {"include_usage": True}
    if t.ignore_eos:
        body["ignore_eos"] = True
    body.update(t.extra_body)
    if t.api == "chat":
        return "/v1/chat/completions", {**body, "messages": req.messages}
    return "/v1/completions", {**body, "prompt": req.prompt()}


def new_record(req: Request, label: str) -> dict:
    return {**req.describe(), "label": label, "status": None, "http_status": None, "error": None,
            "sent_s": None, "ttft_s": None, "e2e_s": None, "itl_s": [], "output_tokens": 0,
            "prompt_tokens": None, "streamed": None, "attempts": 0}


def new_session(t: Target) -> aiohttp.ClientSession:
    """The requests' HTTP client: aiohttp, as ``vllm bench serve`` uses. (httpx's pool costs ~6 ms a
    request and ~10 ms each in a burst of 40 on a 2-core box, which a time-to-429 would measure.)
    No limit on connections; the whole request's limit is ``http_request``'s, a connect's 30 s."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(30.0, t.timeout_s)))


async def http_request(client: aiohttp.ClientSession, t: Target, req: Request, rec: dict, t0: float) -> dict:
    """Send ``req``; fill ``rec``. ``t0``: the run's start (``time.perf_counter()``), for ``sent_s``."""
    path, body = body_of(t, req)
    start = time.perf_counter()
    rec["sent_s"] = start - t0
    rec["streamed"] = t.stream
    try:
        await asyncio.wait_for(_attempts(client, t, path, body, rec, start, req), t.timeout_s)
    except aiohttp.ServerTimeoutError as e:  # (a TimeoutError too: first) the connect's limit
        _fail(rec, "timeout", f"{type(e).__name__}: {e}")
    except asyncio.TimeoutError:
        _fail(rec, "timeout", f"no complete answer within {t.timeout_s:g} s")
    except _CONNECTION as e:
        got = f" after {rec['output_tokens']} streamed tokens" if rec["output_tokens"] else ""
        # refused: nothing was sent (a server gone or not yet up); otherwise a request was lost midway
        _fail(rec, "connection", f"{type(e).__name__}: {e}{got}",
              refused=isinstance(e, aiohttp.ClientConnectorError))
    if rec["status"] == OK:
        if rec["e2e_s"] is None:  # non-streamed: the whole answer, and with it the first token
            rec["e2e_s"] = time.perf_counter() - start
        if rec["ttft_s"] is None:
            rec["ttft_s"] = rec["e2e_s"]
    return rec


async def _attempts(client, t: Target, path: str, body: dict, rec: dict, start: float, req: Request) -> None:
    url = base_url(t.url) + path
    while True:
        rec["attempts"] += 1
        if t.stream:
            await _streamed(client, url, body, t.headers(), rec, start, req)
        else:
            await _whole(client, url, body, t.headers(), rec, req)
        after = rec.get("retry_after_s")
        if (rec["http_status"] not in (429, 503) or after is None or rec["attempts"] > t.retries
                or after > t.retry_max_wait_s):
            return
        await asyncio.sleep(after)
        rec.update(status=None, error=None, http_status=None, retry_after_s=None)


def _fail(rec: dict, kind: str, message: str, **extra) -> None:
    rec["status"] = kind
    rec["error"] = message[:500]
    rec.update(extra)


def _http_error(rec: dict, status: int, headers, content: bytes) -> None:
    try:
        err = json.loads(content)
        msg = (err.get("error") or {}).get("message") if isinstance(err.get("error"), dict) else None
        msg = msg or (err.get("detail") if isinstance(err, dict) else None) or content.decode(errors="replace")
    except ValueError:
        msg = content.decode(errors="replace")
    kind = "http_429" if status == 429 else ("http_5xx" if status >= 500 else "http_4xx")
    ra = headers.get("retry-after")
    try:
        retry_after = float(ra) if ra is not None else None
    except ValueError:
        retry_after = None
    _fail(rec, kind, str(msg), http_status=status, retry_after_s=retry_after)


async def _lines(resp: aiohttp.ClientResponse):
    """The body's lines as they arrive (no length limit per line, unlike aiohttp's own iterator)."""
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode(errors="replace")
    if buf:
        yield buf.decode(errors="replace")


async def _streamed(client, url, body, headers, rec, start, req: Request) -> None:
    async with client.post(url, json=body, headers=headers) as resp:
        rec["http_status"] = resp.status
        if resp.status >= 400:
            _http_error(rec, resp.status, resp.headers, await resp.read())
            return
        done_at, last, chunks, text = None, None, 0, []
        error = None
        # read to the body's end, past [DONE]: closing the connection at [DONE] races the server's last
        # bookkeeping (a server may count that request as cancelled by its client)
        async for line in _lines(resp):
            if not line.startswith("data:") or done_at is not None:
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done_at = time.perf_counter()
                continue
            now = time.perf_counter()
            try:
                ev = json.loads(data)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            if "error" in ev:
                e = ev["error"] if isinstance(ev["error"], dict) else {"message": str(ev["error"])}
                error = error or e
                continue
            piece = _piece(ev)
            if piece:
                chunks += 1
                text.append(piece)
                if rec["ttft_s"] is None:
                    rec["ttft_s"] = now - start
                else:
                    rec["itl_s"].append(now - last)
                last = now
                rec["output_tokens"] = chunks
            if isinstance(ev.get("usage"), dict):
                u = ev["usage"]
                rec["prompt_tokens"] = u.get("prompt_tokens", rec["prompt_tokens"])
                rec["usage_completion_tokens"] = u.get("completion_tokens")
        if rec.get("usage_completion_tokens") is not None:
            rec["output_tokens"] = rec["usage_completion_tokens"]
        _answer(rec, req, "".join(text))
        if error is not None:
            _fail(rec, "stream_error", str(error.get("message") or error), error_code=error.get("code"))
        elif done_at is None:
            _fail(rec, "stream_incomplete", "the stream ended without [DONE] and without an error event")
        else:
            rec["status"] = OK
            rec["e2e_s"] = done_at - start  # the answer is complete at [DONE]


def _piece(ev: dict) -> str:
    out = []
    for c in ev.get("choices") or ():
        if not isinstance(c, dict):
            continue
        if c.get("text"):
            out.append(c["text"])
        delta = c.get("delta") or {}
        if isinstance(delta, dict):
            for k in ("content", "reasoning_content"):
                if delta.get(k):
                    out.append(delta[k])
    return "".join(out)


async def _whole(client, url, body, headers, rec, req: Request) -> None:
    async with client.post(url, json=body, headers=headers) as resp:
        rec["http_status"] = resp.status
        content = await resp.read()
        if resp.status >= 400:
            _http_error(rec, resp.status, resp.headers, content)
            return
    try:
        doc = json.loads(content)
    except ValueError:
        _fail(rec, "stream_incomplete", "the answer is not JSON")
        return
    choices = doc.get("choices") or [{}]
    c = choices[0]
    text = c.get("text") or ((c.get("message") or {}).get("content") or "")
    u = doc.get("usage") or {}
    rec["prompt_tokens"] = u.get("prompt_tokens")
    rec["output_tokens"] = u.get("completion_tokens") if u.get("completion_tokens") is not None else (
        1 if text else 0)
    _answer(rec, req, text)
    rec["status"] = OK


def _answer(rec: dict, req: Request, text: str) -> None:
    if req.expect is not None:
        rec["answer_ok"] = req.expect in text.replace(",", "")
        rec["output_head"] = text[:200]


# ---- gRPC: prefill only ----
async def grpc_request(client, t: Target, req: Request, rec: dict, t0: float) -> dict:
    """One ``Prefill`` call through ``prefill_server.client.AsyncPrefillClient`` (TTFT = the call's
    time: prefill done, first token sampled, KV published), then ``Release`` of its KV."""
    from prefill_server.client import PrefillRpcError  # gRPC mode only

    start = time.perf_counter()
    rec.update(sent_s=start - t0, streamed=False, attempts=1, transport="grpc")
    kwargs = {"model": t.model, "temperature": float(t.temperature)}
    try:
        if t.api == "chat":
            call = client.prefill(messages=req.messages, **kwargs)
        else:
            call = client.prefill(req.prompt(), **kwargs)
        r = await asyncio.wait_for(call, t.timeout_s)
    except asyncio.TimeoutError:
        _fail(rec, "timeout", f"no answer within {t.timeout_s:g} s")
        return rec
    except PrefillRpcError as e:
        _fail(rec, f"grpc_{e.code.name}", e.message, error_type=e.error_type)
        return rec
    rec["ttft_s"] = rec["e2e_s"] = time.perf_counter() - start
    rec.update(status=OK, output_tokens=1, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
               server_timings=dict(r.timings))
    try:
        rec["released"] = await asyncio.wait_for(client.release(r.request_id), 30)
    except (PrefillRpcError, asyncio.TimeoutError) as e:
        rec["released"] = False
        rec["release_error"] = str(e)[:200]
    return rec

"""ASGI middleware for requests with a body: a size limit, and a client that hangs up cancels its work.

Uvicorn does not cancel a handler whose client disconnects: it only reports ``http.disconnect`` to
whoever next calls ``receive()``, and a handler awaiting a prefill never does. So a prompt whose
client had gone was still computed and forwarded to the decode. This middleware reads the body
first (refusing one over ``max_body_bytes`` with 413, by its Content-Length before reading when it
has one), then runs the app as a task while it waits on the connection itself: a disconnect before
the response is complete cancels that task, and the cancellation reaches whatever the handler
awaits (the engine aborts the prefill and frees its blocks; an open decode request is closed, and
vLLM aborts it). The app sees the body as usual, then ``http.disconnect`` once the client is gone.

A request the server itself stops (still running when ``--drain-timeout`` ends, or at a second
SIGTERM) ends with 503 ``ServerStopping`` (a stream: an error event and ``[DONE]``), not uvicorn's
bare 500 and a traceback.
"""
from __future__ import annotations

import asyncio
import json
import logging

from prefill_server.serving.relay import error_event

log = logging.getLogger(__name__)

_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


def _too_large(limit: int) -> bytes:
    return json.dumps({"error": {
        "message": f"the request body is larger than {limit} bytes; send a smaller one, or start the "
                   "server with a larger --max-body-bytes",
        "type": "PayloadTooLarge", "param": None, "code": 413}}).encode()


class RequestGuard:
    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return  # refused, or the client left before sending it all
        await self._run(scope, receive, send, body)

    async def _read_body(self, scope, receive, send) -> bytes | None:
        limit = self.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            await self._refuse(send)
            return None
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(send)
                return None
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, send) -> None:
        content = _too_large(self.max_body_bytes)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(content)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": content})

    async def _run(self, scope, receive, send, body: bytes) -> None:
        gone = asyncio.Event()
        delivered = complete = False
        started: dict | None = None  # the response's start message, once sent

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def tracked_send(msg) -> None:
            nonlocal complete, started
            if msg["type"] == "http.response.start":
                started = msg
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                complete = True
            await send(msg)

        app = asyncio.ensure_future(self.app(scope, replay, tracked_send))
        watch = asyncio.ensure_future(receive())  # (the body is read: the next message is a disconnect)
        try:
            done, _ = await asyncio.wait({app, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch in done and not app.done():
                gone.set()
                if not complete:
                    log.info("client disconnected from %s %s: cancelling its request", scope["method"],
                             scope["path"])
                    app.cancel()
            try:
                await app
            except asyncio.CancelledError:
                if not gone.is_set():
                    raise  # (the server is cancelling us: not the client's doing)
        except asyncio.CancelledError:
            if gone.is_set() or complete:
                raise
            log.warning("%s %s stopped by the server's shutdown before it finished", scope["method"], scope["path"])
            await _stopped(send, started)  # (and the cancellation ends here: uvicorn has nothing to report)
        finally:
            for t in (app, watch):
                if not t.done():
                    t.cancel()


_STOPPING = ("the server stopped before this request finished (it was still running when the shutdown's "
             "--drain-timeout ended, or at a second SIGTERM): retry it")


async def _stopped(send, started: dict | None) -> None:
    """End a response the server's shutdown cut off: a 503, or, within a stream already started, an
    OpenAI error event and [DONE]."""
    try:
        if started is None:
            content = json.dumps({"error": {"message": _STOPPING, "type": "ServerStopping", "param": None,
                                            "code": 503}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"content-length", str(len(content)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": content})
            return
        stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                     for k, v in started.get("headers", []))
        tail = error_event(_STOPPING, "ServerStopping", 503) + b"data: [DONE]\n\n" if stream else b""
        await send({"type": "http.response.body", "body": tail})
    except Exception:  # noqa: BLE001 (the connection may be gone already: nothing left to tell)
        pass

"""RequestGuard when the server itself stops a request (``--drain-timeout`` ended, a second SIGTERM):
the client gets a 503 ServerStopping, or, inside a stream already started, an error event and
[DONE]; the cancellation ends there. A client that hung up still cancels its request."""
from __future__ import annotations

import asyncio
import json

from prefill_server.serving.request_guard import RequestGuard

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"2")]}


def run_cut_off(app, client_leaves: bool = False) -> tuple[list[dict], BaseException | None]:
    sent: list[dict] = []

    async def main():
        body_sent, leave = False, asyncio.Event()

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": b"{}", "more_body": False}
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)

        task = asyncio.ensure_future(RequestGuard(app, 1000)(dict(SCOPE), receive, send))
        await asyncio.sleep(0.05)  # the app is running
        if client_leaves:
            leave.set()
        else:
            task.cancel()  # what uvicorn does at the drain timeout, and serve at a second signal
        try:
            await task
            return None
        except BaseException as e:  # noqa: BLE001
            return e

    return sent, asyncio.run(main())


async def waiting_app(scope, receive, send):
    await receive()
    await asyncio.sleep(60)


async def streaming_app(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
    await send({"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True})
    await asyncio.sleep(60)


def test_a_request_cut_off_before_its_answer_gets_503():
    sent, err = run_cut_off(waiting_app)
    assert err is None  # (uvicorn has nothing left to report)
    start, body = sent
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert json.loads(body["body"])["error"]["type"] == "ServerStopping"


def test_a_stream_cut_off_ends_with_an_error_event_and_done():
    sent, err = run_cut_off(streaming_app)
    assert err is None
    tail = sent[-1]
    assert not tail.get("more_body", False)
    events = tail["body"].decode().split("\n\n")
    assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == 503 and events[1] == "data: [DONE]"


def test_a_client_that_leaves_still_cancels_without_an_answer():
    sent, err = run_cut_off(waiting_app, client_leaves=True)
    assert err is None and sent == []

"""The relay of a decode's streamed answer to the client, checked as a whole answer is.

A whole answer's ``usage.prompt_tokens`` tells whether the decode read the prompt our KV was made
for (``relay.check_prompt_tokens``). A stream carries usage only where asked, so a vLLM decode is
always asked ``stream_options: {include_usage, continuous_usage_stats}``: vLLM 0.32 then puts the
usage so far on every chunk, the first included (chat: the role chunk; completions: the first
text chunk), and the check reads the first. The client still gets what it asked, as vLLM alone
gives it (``should_include_usage``, chat_completion/serving.py, completion/serving.py):

- per-chunk usage only with ``include_usage`` and ``continuous_usage_stats``;
- the last chunk, ``choices: []`` with the usage and ``system_fingerprint``, only with
  ``include_usage``; without it vLLM stamps the fingerprint on the chunk that finishes the choice
  instead, so that chunk is held until the decode's usage chunk brings the fingerprint (the next
  event: the server answers one choice).

With a prefix cache, each usage the client gets says in ``prompt_tokens_details.cached_tokens`` how
many prompt tokens came from it, as whole answers do. Events that need no edit go through as the
decode's bytes; edited ones are written compactly, as vLLM writes them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import httpx

from prefill_server.errors import PromptMismatch
from prefill_server.serving.first_token import with_cached_tokens
from prefill_server.serving.openai_schema import usage_asked
from prefill_server.serving.relay import check_prompt_tokens, data_lines, error_event, renamer, sse

if TYPE_CHECKING:
    from prefill_server.serving.gateway import Gateway, _Call

log = logging.getLogger("prefill_server.serving.gateway")
_BROKEN = (httpx.HTTPError, OSError)  # a decode that died or dropped the connection mid-answer
DECODE_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


class StreamUsage:
    """One stream's usage: checked on the decode's first usage, then cut to what the client asked."""

    def __init__(self, include: bool, continuous: bool, expected: int, request_id: str):
        self.include, self.continuous = include, continuous
        self.expected, self.request_id = expected, request_id
        self.checked = False
        self._held: list[dict] = []  # finishing chunks waiting for the fingerprint
        # the prefill's prefix-cache hit once known (a streamed prefill's, when it ended); None: no cache
        self.cached_tokens: Callable[[], int | None] = lambda: None

    @classmethod
    def ask(cls, body: dict, expected: int, request_id: str) -> StreamUsage | None:
        """Ask the decode (``body``, its request) for usage on every chunk; None, and ``body`` left
        as it is, where the client's stream_options are not ones vLLM takes (the decode refuses
        them, as it would have)."""
        asked = usage_asked(body.get("stream_options"))
        if asked is None:
            return None
        body["stream_options"] = {**(body.get("stream_options") or {}), **DECODE_STREAM_OPTIONS}
        return cls(*asked, expected, request_id)

    def feed(self, data: str) -> list[str | dict]:
        """The client's events for one of the decode's ``data:`` payloads: the payload itself where
        nothing changes, else the edited events, parsed. Raises ``PromptMismatch`` at the first
        usage of another prompt's count."""
        cached = self.cached_tokens()
        if data == "[DONE]" or (self.checked and self.continuous and cached is None):
            return [*self.flush(), data]  # (as asked: the decode's events are the client's)
        try:
            ev = json.loads(data)
        except ValueError:
            ev = None
        if not isinstance(ev, dict) or "error" in ev:
            return [*self.flush(), data]
        if not self.checked and isinstance(ev.get("usage"), dict):
            check_prompt_tokens(ev, self.expected, self.request_id)
            self.checked = True
        if self.continuous:
            return [self._cached(ev, cached) or data]
        if ev.get("choices") == []:  # the usage chunk, the last before [DONE]
            if self.include:
                return [*self.flush(), self._cached(ev, cached) or data]
            held = self.flush()
            if ev.get("system_fingerprint") is not None:
                for h in held:
                    h["system_fingerprint"] = ev["system_fingerprint"]
            return held
        out = self.flush()
        ev.pop("usage", None)
        if not self.include and any(isinstance(c, dict) and c.get("finish_reason") is not None
                                    for c in ev.get("choices") or ()):
            self._held.append(ev)
            return out
        return [*out, ev]

    @staticmethod
    def _cached(ev: dict, cached: int | None) -> dict | None:
        """``ev`` with the prefix cache's hit in its usage; None where there is nothing to add."""
        if cached is None or not isinstance(ev.get("usage"), dict):
            return None
        return {**ev, "usage": with_cached_tokens(ev["usage"], cached)}

    def flush(self) -> list[dict]:
        """The chunks held (a stream that ends without the usage chunk: they go without the fingerprint)."""
        held, self._held = self._held, []
        return held


async def relay(gw: Gateway, resp: httpx.Response, c: _Call) -> AsyncIterator[bytes]:
    """The decode's events (with ``c.first``: t1's first, then the decode's rewritten). A stream
    that breaks or ends without ``[DONE]`` gets an OpenAI error event, as vLLM sends one, so the
    client can tell a cut answer from a whole one. A decode that counted another prompt: while
    nothing went to the client, ``PromptMismatch`` is raised (the client gets the HTTP error a whole
    answer gets); after t1 went ahead, an error event and ``[DONE]``, and the decode is not read on."""
    state = c.first.stream_start() if c.first else None
    outcome = "cancelled"
    done = failed = sent = False
    client, served = c.decode.decode.client, gw.service.info.served_name
    rename = renamer(c.decode.decode.model, served)
    deadline = asyncio.get_running_loop().time() + client.timeout_s  # (--decode-timeout: the whole answer)
    try:
        if state is not None:
            yield state.first(served)
            sent = True
        late = mismatch = None
        try:
            async for data in data_lines(resp, deadline):
                done = done or data == "[DONE]"
                failed = failed or data.startswith('{"error"')
                for item in c.usage.feed(data) if c.usage else (data,):
                    yield state.event(item) if state is not None else rename(sse(item))
                    sent = True
        except (asyncio.TimeoutError, httpx.ReadTimeout):
            late, reason = client.timed_out(c.path), None
        except _BROKEN as e:
            reason = f"the decode's stream broke ({type(e).__name__}: {e})"
        except PromptMismatch as e:
            if not sent:
                raise
            mismatch, reason = e, None
        else:
            reason = None if done else "the decode's stream ended before [DONE]"
        for item in c.usage.flush() if c.usage else ():  # (a stream cut before its usage chunk)
            yield state.event(item) if state is not None else rename(sse(item))
        if mismatch is not None:
            gw.service.release(c.request_id)  # (its answer is not the client's: nothing is to read our KV now)
            yield error_event(f"{mismatch.message}; the answer is incomplete", "PromptMismatch",
                              mismatch.http_status)
            yield b"data: [DONE]\n\n"
            outcome = "PromptMismatch"
        elif late is not None:  # slow, not down: it keeps taking requests
            log.warning("request %s: %s", c.request_id, late.message)
            yield error_event(f"{late.message}; the answer is incomplete", "DecodeTimeout", 504)
            yield b"data: [DONE]\n\n"
            outcome = "DecodeTimeout"
        elif reason is not None:
            log.warning("request %s: %s", c.request_id, reason)
            gw.decodes.report_unreachable(c.decode.decode, f"{reason} at {c.decode.decode.url}")
            yield error_event(f"{reason}; the answer is incomplete", "DecodeUnavailable", 502)
            yield b"data: [DONE]\n\n"
            outcome = "DecodeStreamBroken"
        else:
            outcome = "DecodeFailed" if failed else "ok"
            gw.metrics.e2e_time.observe(time.monotonic() - c.t0)
    except (asyncio.CancelledError, GeneratorExit):
        if done:  # the client had [DONE] (a yield hands its value over before it suspends) and closed
            outcome = "DecodeFailed" if failed else "ok"
        raise  # else the client went away mid-answer ("cancelled")
    except PromptMismatch:  # nothing was sent: the gateway answers with the error (and frees the KV)
        outcome = "PromptMismatch"
        raise
    except BaseException:
        outcome = "InternalError"
        raise
    finally:
        gw.leases.drop(c.request_id)
        await resp.aclose()
        c.decode.end()
        if c.release_after:
            gw.service.release(c.request_id)
        c.outcome.record(outcome)

"""The decodes a gateway sends requests to, and which of them are up, so that requests spread over the
healthy ones and readiness reflects them.

    assign(group)       the up decode of ``group`` with the fewest outstanding requests (ties in
                        turn); ``DecodeDown`` when none is up, before anything is computed
    reassign(a, why)    the request could not reach ``a``'s decode (nothing was sent): mark it down and
                        take another of the same group (the same kv_transfer_params work there)
    Assignment.end()    the request is done with its decode (counted once)

Each decode has a background check of its ``GET /health`` every ``interval_s`` (every second while it
is down); an up decode is marked down by two failed checks in a row, not one. A request that cannot
reach a decode marks it down at once and wakes its check, which marks it up again as soon as it
answers and ``admit`` (when given) lets it back: a decode that was down may have come back as
another server, so the tokenizer parity probe runs again first (``token_parity.recheck``); one it
keeps out is checked every ``interval_s``. ``subscribe(on_change)`` hears whether any decode is up
(the gRPC health service follows it).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from prefill_server.errors import DecodeDown
from prefill_server.serving.decode_client import DecodeClient

log = logging.getLogger(__name__)
DOWN_INTERVAL_S = 1.0


@dataclass(eq=False)
class Decode:
    client: DecodeClient
    group: str = ""  # TransferBackend.decode_group: decodes that take the same kv_transfer_params
    model: str = ""  # the model id the decode serves (what it is sent, whatever name clients use here)
    up: bool = True  # the server starts once every decode answered (discovery)
    reason: str | None = None  # why it is down
    outstanding: int = 0  # requests sent to it and not finished
    held_out: bool = False  # it answers, but ``admit`` keeps it out (reason says why)
    wake: asyncio.Event | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.client.base_url


class Assignment:
    """A request's decode; counts the request as outstanding there until ``end``."""

    def __init__(self, decodes: DecodeSet, decode: Decode):
        self._set, self.decode, self._ended = decodes, decode, False
        decode.outstanding += 1
        decodes._publish(decode)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.decode.outstanding -= 1
            self._set._publish(self.decode)


class DecodeSet:
    def __init__(self, decodes: Sequence[Decode], interval_s: float = 5.0, metrics=None,
                 admit: Callable[[Decode], Awaitable[str | None]] | None = None):
        assert decodes, "a DecodeSet needs at least one decode"
        self.decodes, self.interval_s, self.metrics = list(decodes), interval_s, metrics
        self.admit = admit  # a down decode that answers again: why it stays out, or None
        self._turn = itertools.count()
        self._listeners: list[Callable[[bool], None]] = []
        self._tasks: list[asyncio.Task] = []
        for d in self.decodes:
            self._publish(d)

    @classmethod
    def of(cls, clients: DecodeClient | Sequence[DecodeClient], interval_s: float = 5.0, metrics=None) -> DecodeSet:
        clients = [clients] if isinstance(clients, DecodeClient) else list(clients)
        return cls([Decode(c) for c in clients], interval_s, metrics)

    # ---- choosing ----
    def assign(self, group: str | None = None, avoid: Sequence[Decode] = ()) -> Assignment:
        """The least busy up decode (of ``group`` if given). Raises ``DecodeDown`` when none is up."""
        d = self._pick(group, avoid)
        if d is None:
            raise DecodeDown(self._none_up(group), retry_after_s=DOWN_INTERVAL_S * 2)
        return Assignment(self, d)

    def reassign(self, a: Assignment, reason: str, tried: list[Decode]) -> Assignment | None:
        """``a``'s decode was not reached: mark it down, end ``a``, and take another up decode of its
        group not in ``tried`` (None if there is none)."""
        a.end()
        self.report_unreachable(a.decode, reason)
        d = self._pick(a.decode.group, tried)
        return None if d is None else Assignment(self, d)

    def _pick(self, group: str | None, avoid: Sequence[Decode]) -> Decode | None:
        ups = [d for d in self.decodes if d.up and d not in avoid and (group is None or d.group == group)]
        if not ups:
            return None
        least = min(d.outstanding for d in ups)
        ties = [d for d in ups if d.outstanding == least]
        return ties[next(self._turn) % len(ties)]

    def _none_up(self, group: str | None) -> str:
        down = "; ".join(f"the decode at {d.url} is down ({d.reason})" for d in self.decodes
                         if group is None or d.group == group)
        return f"{down}; no prefill was started: retry once a decode is back"

    # ---- health ----
    @property
    def any_up(self) -> bool:
        return any(d.up for d in self.decodes)

    def down_reasons(self) -> list[str]:
        return [f"the decode at {d.url} is down ({d.reason})" for d in self.decodes if not d.up]

    def subscribe(self, on_change: Callable[[bool], None]) -> None:
        """``on_change(any_up)`` runs whenever "some decode is up" turns false or true."""
        self._listeners.append(on_change)

    def report_unreachable(self, decode: Decode, reason: str) -> None:
        """A request could not reach ``decode``: down until its health check answers again."""
        self._set(decode, False, reason)
        if decode.wake is not None:
            decode.wake.set()

    def start(self) -> None:
        for d in self.decodes:
            d.wake = asyncio.Event()
            self._tasks.append(asyncio.ensure_future(self._watch(d)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def close(self) -> None:
        await self.stop()
        for d in self.decodes:
            await d.client.close()

    def _set(self, d: Decode, up: bool, reason: str | None) -> None:
        was_any = self.any_up
        changed = up != d.up
        d.up, d.reason = up, reason
        if not changed:
            return
        self._publish(d)
        if up:
            log.info("decode %s is up again", d.url)
        else:
            log.warning("decode %s is down: %s", d.url, reason)
        if self.any_up != was_any:
            for f in self._listeners:
                try:
                    f(self.any_up)
                except Exception:  # noqa: BLE001 - a listener never stops the checks
                    log.exception("decode health listener failed")

    def _publish(self, d: Decode) -> None:
        if self.metrics is not None:
            self.metrics.decode_up.labels(d.url).set(1 if d.up else 0)
            self.metrics.decode_outstanding.labels(d.url).set(d.outstanding)

    async def _check(self, d: Decode) -> str | None:
        """One health check; a decode that is up gets a second at once before a failure marks it down:
        one slow answer (this process or the decode paused for a while) is not an outage, and a
        decode that is gone fails the second check too, in milliseconds."""
        for _ in range(2 if d.up else 1):
            try:
                reason = await d.client.health(timeout_s=max(1.0, min(5.0, self.interval_s)))
            except Exception as e:  # noqa: BLE001 - never let the checker die
                reason = f"{type(e).__name__}: {e}"
            if reason is None:
                return None
        return reason

    async def _watch(self, d: Decode) -> None:
        assert d.wake is not None
        while True:
            try:
                await asyncio.wait_for(d.wake.wait(), self.interval_s if d.up or d.held_out else DOWN_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
            d.wake.clear()
            reason = await self._check(d)
            held = False
            if reason is None and not d.up and self.admit is not None:
                try:
                    reason = await self.admit(d)
                except Exception as e:  # noqa: BLE001 - a failed check keeps it out, and is retried
                    reason = f"its re-admission check failed ({type(e).__name__}: {e})"
                held = reason is not None
            d.held_out = held
            self._set(d, reason is None, reason)

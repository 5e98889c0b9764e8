"""Whether the decode is up, as far as the gateway knows, so that readiness reflects it and a request
arriving while it is down fails at once instead of after a whole prefill.

A background task asks the decode's ``GET /health`` every ``interval_s`` (every second while it is
down). A request that cannot reach the decode marks it down at once and wakes the task, which marks
it up again as soon as it answers. ``on_change(up)`` lets the gRPC health service follow.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prefill_server.errors import DecodeDown
from prefill_server.serving.decode_client import DecodeClient

log = logging.getLogger(__name__)
DOWN_INTERVAL_S = 1.0


class DecodeHealth:
    def __init__(self, client: DecodeClient, interval_s: float = 5.0,
                 on_change: Callable[[bool], None] | None = None):
        self.client, self.interval_s = client, interval_s
        self.up = True  # the server starts only after the decode answered (discovery)
        self.reason: str | None = None
        self._on_change = [on_change] if on_change else []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def subscribe(self, on_change: Callable[[bool], None]) -> None:
        self._on_change.append(on_change)

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def check(self) -> None:
        """Raise ``DecodeDown`` while the decode is known to be down."""
        if not self.up:
            raise DecodeDown(f"the decode at {self.client.base_url} is down ({self.reason}); no prefill was "
                             "started: retry once it is back", retry_after_s=DOWN_INTERVAL_S * 2)

    def report_unreachable(self, reason: str) -> None:
        """A request could not reach the decode: down until its health check answers again."""
        self._set(False, reason)
        if self._wake is not None:
            self._wake.set()

    def _set(self, up: bool, reason: str | None) -> None:
        changed = up != self.up
        self.up, self.reason = up, reason
        if not changed:
            return
        if up:
            log.info("decode %s is up again", self.client.base_url)
        else:
            log.warning("decode %s is down: %s", self.client.base_url, reason)
        for f in self._on_change:
            try:
                f(up)
            except Exception:  # noqa: BLE001 - a listener never stops the checks
                log.exception("decode health listener failed")

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s if self.up else DOWN_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                reason = await self.client.health(timeout_s=max(1.0, min(5.0, self.interval_s)))
            except Exception as e:  # noqa: BLE001 - never let the checker die
                reason = f"{type(e).__name__}: {e}"
            self._set(reason is None, reason)

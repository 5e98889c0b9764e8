"""Keeps the leased KV of requests whose decode call is open from expiring.

A lease ends when the decode says it has read the KV, or after ``--lease-ttl`` without a read (the
decode never came). A stock vLLM decode extends it with heartbeats while the request queues there,
but one that stalls without them (a frozen worker, a long pause) would otherwise read the blocks
after they were freed and handed to another request, and answer 200 from that request's KV. While
the gateway's own call to the decode is open, the decode has not given up on the request, so the
gateway holds its lease: every third of the TTL, one ``keep`` for all such requests. When the call
ends the lease goes back to its TTL (the decode has read by then, or failed and the gateway released).

Requests reaching this server through a PD router (its decode is called by the router, not here)
keep the plain lease, as a vLLM prefill's are.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, keep: Callable[[list[str]], None], ttl_s: float):
        self._keep = keep  # holds these requests' leases another TTL (``PrefillService.keep``)
        self.interval_s = ttl_s / 3
        self._held: set[str] = set()
        self._task: asyncio.Task | None = None

    def hold(self, request_id: str) -> None:
        """From now until ``drop``: called on the event loop."""
        self._held.add(request_id)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def drop(self, request_id: str) -> None:
        self._held.discard(request_id)

    @property
    def held(self) -> frozenset[str]:
        return frozenset(self._held)

    async def _run(self) -> None:
        try:
            while self._held:
                await asyncio.sleep(self.interval_s)
                if self._held:
                    try:
                        self._keep(sorted(self._held))
                    except Exception:  # noqa: BLE001 - a failed round is tried again at the next
                        log.exception("keeping %d leases failed", len(self._held))
        finally:
            self._task = None

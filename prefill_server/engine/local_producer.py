"""Transfer mode ``local``: no decode peer; the KV stays in the pool under a lease until the client
releases it (gRPC ``Release``) or it expires. Used by tests and benchmarks of the engine alone."""
from __future__ import annotations

import threading
from collections.abc import Callable

from kv_transfer.base import LeaseProducer, Route
from prefill_server.engine.kv_pool import KVPool


class LocalProducer(LeaseProducer):
    routes = frozenset({Route.LEASE})

    def __init__(self, pool: KVPool, lease_ttl_s: float = 30.0):
        self.pool, self.lease_ttl_s = pool, lease_ttl_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._expire_loop, name="lease-expiry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def _expire_loop(self) -> None:
        while not self._stop.wait(0.5):
            self.pool.expire()

    def publish(self, request_id: str, block_ids: list[int], num_tokens: int, *, decode_url: str | None = None,
                cached_tokens: int = 0) -> dict:
        self.pool.lease(request_id, block_ids, self.lease_ttl_s, num_tokens)
        return {"transfer_mode": "local", "request_id": request_id, "num_tokens": num_tokens,
                "block_ids": list(block_ids), "cached_tokens": cached_tokens}

    def abort(self, request_id: str, reason: str = "", on_idle: Callable[[], None] | None = None) -> bool:
        released = self.pool.release(request_id)
        if on_idle is not None:  # (nothing is ever in flight here)
            on_idle()
        return released

"""Run our gateway in-process for end-to-end tests that also need to look inside the engine (pool
block counts, the negative control)."""
from __future__ import annotations

import time

from prefill_server.serving.background import BackgroundServer
from prefill_server.serving.decode_client import DecodeClient
from prefill_server.serving.decodes import Decode, DecodeSet
from prefill_server.serving.http import create_app
from prefill_server.serving.service import PrefillService


class GatewayThread:
    def __init__(self, service: PrefillService, decode_url: str | list[str] | None, health_interval_s: float = 5.0):
        self.service = service
        self.decode_urls = [decode_url] if isinstance(decode_url, str) else list(decode_url or [])
        self.health_interval_s = health_interval_s
        self._server: BackgroundServer | None = None

    def start(self) -> "GatewayThread":
        self.service.worker.engine.start()
        decodes = DecodeSet([Decode(DecodeClient(u)) for u in self.decode_urls], self.health_interval_s,
                            self.service.metrics) if self.decode_urls else None
        self._server = BackgroundServer(create_app(self.service, decodes)).start()
        self.url = self._server.url
        return self

    def stop(self) -> None:
        if self._server:
            self._server.stop()
        self.service.worker.engine.stop()

    def wait_pool_empty(self, timeout_s: float = 20.0) -> int:
        """Blocks in use once the decode's notifications have come in (or the timeout passed)."""
        pool = self.service.worker.engine.pool
        deadline = time.monotonic() + timeout_s
        while pool.num_used and time.monotonic() < deadline:
            time.sleep(0.05)
        return pool.num_used

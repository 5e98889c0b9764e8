"""Run our gateway in-process (uvicorn in a thread) for end-to-end tests that also need to look
inside the engine (pool block counts, the negative control)."""
from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from prefill_server.serving.http import create_app
from prefill_server.serving.proxy import DecodeClient
from prefill_server.serving.server import bind
from prefill_server.serving.service import PrefillService


class GatewayThread:
    def __init__(self, service: PrefillService, decode_url: str | None):
        self.service = service
        self.decode_url = decode_url
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "GatewayThread":
        self.service.engine.start()

        def run() -> None:
            decode = DecodeClient(self.decode_url) if self.decode_url else None
            app = create_app(self.service, decode)
            self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
            asyncio.run(self._server.serve(sockets=[self.sock]))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not (self._server and self._server.started):
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server:
            self._server.should_exit = True
        if self._thread:
            self._thread.join(timeout=15)
        self.service.engine.stop()

    def wait_pool_empty(self, timeout_s: float = 20.0) -> int:
        """Blocks in use once the decode's notifications have come in (or the timeout passed)."""
        pool = self.service.engine.pool
        deadline = time.monotonic() + timeout_s
        while pool.num_used and time.monotonic() < deadline:
            time.sleep(0.05)
        return pool.num_used

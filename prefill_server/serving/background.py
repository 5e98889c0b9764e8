"""An ASGI app served by uvicorn on its own thread and event loop: for embedding the gateway in a
process that does other work (tests, notebooks), where ``serve`` would own the main thread."""
from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from prefill_server.serving.server import bind


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[self.sock])),
                                        name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

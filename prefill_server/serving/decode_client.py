"""HTTP client for the decode instance (a vLLM OpenAI server)."""
from __future__ import annotations

import asyncio

import httpx

from prefill_server.errors import DecodeNotReached, DecodeTimeout, DecodeUnavailable

# An idle connection is dropped here after this long, well before a vLLM server closes it (uvicorn's
# keep-alive there: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): with both at 5 s a request sent on a connection
# the decode was closing at that moment failed with a ReadError (502) though the decode was up.
KEEPALIVE_S = 2.0


class DecodeClient:
    """``timeout_s`` (--decode-timeout): the most one request's whole answer may take, streamed or
    not (a stream's relay holds it to ``timed_out``'s deadline)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # (no cap on connections: every answer in flight holds one, and httpx's default of 100
        # would queue the 101st request to a decode that batches hundreds)
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                             keepalive_expiry=KEEPALIVE_S))

    def timed_out(self, path: str) -> DecodeTimeout:
        return DecodeTimeout(f"the decode at {self.base_url}{path} did not finish its answer within --decode-timeout "
                             f"{self.timeout_s:g} s; the request there was closed. Ask for fewer tokens "
                             "(max_tokens), or start the server with a larger --decode-timeout")

    async def close(self) -> None:
        await self._client.aclose()

    def _unreachable(self, path: str, e: Exception) -> DecodeUnavailable:
        # a failed connect sent nothing: the request may go to another decode with the same KV
        cls = DecodeNotReached if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) else DecodeUnavailable
        return cls(f"the decode at {self.base_url}{path} could not be reached ({type(e).__name__}: {e}); "
                   "check --decode-url and that the decode is up")

    async def post(self, path: str, body: dict) -> httpx.Response:
        try:
            return await asyncio.wait_for(self._client.post(path, json=body), self.timeout_s)
        except (asyncio.TimeoutError, httpx.ReadTimeout, httpx.WriteTimeout):
            raise self.timed_out(path) from None
        except httpx.HTTPError as e:
            raise self._unreachable(path, e) from None

    async def open_stream(self, path: str, body: dict) -> httpx.Response:
        """Send a streaming request; the caller iterates it and must ``aclose`` it."""
        try:
            req = self._client.build_request("POST", path, json=body)
            return await self._client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise self._unreachable(path, e) from None

    async def health(self, timeout_s: float = 5.0) -> str | None:
        """None if ``GET /health`` answers 200 within timeout_s, else what went wrong."""
        try:
            r = await self._client.get("/health", timeout=timeout_s)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return None if r.status_code == 200 else f"GET /health answered {r.status_code}"

"""HTTP client for the decode instance (vLLM / SGLang OpenAI server)."""
from __future__ import annotations

from typing import AsyncIterator

import httpx

from prefill_server.errors import DecodeUnavailable


class DecodeClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.base_url,
                                         timeout=httpx.Timeout(timeout_s, connect=10.0))

    async def close(self) -> None:
        await self._client.aclose()

    def _unreachable(self, path: str, e: Exception) -> DecodeUnavailable:
        return DecodeUnavailable(f"the decode at {self.base_url}{path} could not be reached "
                                 f"({type(e).__name__}: {e}); check --decode-url and that the decode is up")

    async def post(self, path: str, body: dict) -> httpx.Response:
        try:
            return await self._client.post(path, json=body)
        except httpx.HTTPError as e:
            raise self._unreachable(path, e) from None

    async def open_stream(self, path: str, body: dict) -> httpx.Response:
        """Send a streaming request; the caller iterates ``aiter_raw`` and must ``aclose`` it."""
        try:
            req = self._client.build_request("POST", path, json=body)
            return await self._client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise self._unreachable(path, e) from None

    @staticmethod
    async def relay(resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()

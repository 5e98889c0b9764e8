"""The pipeline the gRPC API exists for: prefill here, then the decode (vLLM's OpenAI server, started
with a KV connector that reads our KV) continues from the returned ``kv_transfer_params``.

The decode is sent the exact token ids we prefilled (``/v1/completions`` with a token-id prompt), so
text and chat prompts reach it tokenized once, by us, and its prompt matches our KV token for token.
If the decode call fails or the caller stops reading early, the KV is released at once.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Iterator, Sequence

import httpx

from prefill_server.client._common import PrefillResult
from prefill_server.client.aio import AsyncPrefillClient
from prefill_server.client.sync import PrefillClient


class DecodeFailed(Exception):
    """The decode answered with an error status; ``status`` and ``body`` are its reply."""

    def __init__(self, status: int, body: str):
        super().__init__(f"the decode answered HTTP {status}: {body[:500]}")
        self.status, self.body = status, body


def decode_request(result: PrefillResult, *, max_tokens: int, temperature: float = 0.0, stream: bool = True,
                   **fields) -> dict:
    """The decode's /v1/completions body for a prefilled prompt (needs return_prompt_token_ids)."""
    if result.prompt_token_ids is None:
        raise ValueError("prefill with return_prompt_token_ids=True: the decode needs the token ids")
    return {"model": result.model, "prompt": result.prompt_token_ids, "max_tokens": max_tokens,
            "temperature": temperature, "stream": stream, "kv_transfer_params": result.kv_transfer_params,
            **fields}


def _sse_text(line: str) -> str | None:
    """The text delta of one server-sent-events line of a streamed completion (None: not a delta)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    choices = json.loads(data).get("choices") or []
    return choices[0].get("text") or None if choices else None


def stream_completion(client: PrefillClient, decode_url: str, prompt: str | Sequence[int] | None = None, *,
                      messages: Sequence[dict] | None = None, max_tokens: int = 64, temperature: float = 0.0,
                      timeout: float = 600.0, http: httpx.Client | None = None,
                      prefill_kwargs: dict | None = None, **decode_fields) -> Iterator[str]:
    """Prefill over gRPC, then stream the decode's answer as text deltas."""
    r = client.prefill(prompt, messages=messages, temperature=temperature, return_prompt_token_ids=True,
                       **(prefill_kwargs or {}))
    body = decode_request(r, max_tokens=max_tokens, temperature=temperature, **decode_fields)
    own = http is None
    http = http or httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0))
    try:
        with http.stream("POST", decode_url.rstrip("/") + "/v1/completions", json=body) as resp:
            if resp.status_code >= 400:
                raise DecodeFailed(resp.status_code, resp.read().decode(errors="replace"))
            for line in resp.iter_lines():
                text = _sse_text(line)
                if text:
                    yield text
    except BaseException:  # decode refused or unreachable, or the caller stopped: nobody will read it
        _release_quietly(client, r.request_id)
        raise
    finally:
        if own:
            http.close()


async def astream_completion(client: AsyncPrefillClient, decode_url: str,
                             prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict] | None = None,
                             max_tokens: int = 64, temperature: float = 0.0, timeout: float = 600.0,
                             http: httpx.AsyncClient | None = None, prefill_kwargs: dict | None = None,
                             **decode_fields) -> AsyncIterator[str]:
    """The asyncio version of stream_completion."""
    r = await client.prefill(prompt, messages=messages, temperature=temperature, return_prompt_token_ids=True,
                             **(prefill_kwargs or {}))
    body = decode_request(r, max_tokens=max_tokens, temperature=temperature, **decode_fields)
    own = http is None
    http = http or httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))
    try:
        async with http.stream("POST", decode_url.rstrip("/") + "/v1/completions", json=body) as resp:
            if resp.status_code >= 400:
                raise DecodeFailed(resp.status_code, (await resp.aread()).decode(errors="replace"))
            async for line in resp.aiter_lines():
                text = _sse_text(line)
                if text:
                    yield text
    except BaseException:
        try:
            await client.release(r.request_id, timeout=5)
        except Exception:
            pass
        raise
    finally:
        if own:
            await http.aclose()


def _release_quietly(client: PrefillClient, request_id: str) -> None:
    try:
        client.release(request_id, timeout=5)
    except Exception:
        pass

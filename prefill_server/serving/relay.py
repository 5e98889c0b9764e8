"""The pieces of answers the gateway builds and relays: SSE chaining and error events, the first
token alone as an answer, the checks made on a decode's answer (``gateway.py`` runs the policy)."""
from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable

from prefill_server.errors import DecodeFailed, PrefillError, PromptMismatch
from prefill_server.engine.worker import PrefillResult
from prefill_server.serving import prefill_instance as pi
from prefill_server.serving.service import PrefillService

log = logging.getLogger("prefill_server.serving.gateway")


async def chain(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


def max_tokens_of(body: dict) -> int | None:
    n = body.get("max_completion_tokens") or body.get("max_tokens")
    return n if isinstance(n, int) else None


def decode_outcome(status: int) -> str:
    return "DecodeRejected" if status < 500 else "DecodeFailed"


def sse(item: str | dict) -> bytes:
    """An event for the client: a decode's payload as it came, or an event written here, compactly
    (as vLLM writes its own)."""
    if isinstance(item, dict):
        item = json.dumps(item, separators=(",", ":"), ensure_ascii=False)
    return f"data: {item}\n\n".encode()


def error_event(message: str, etype: str, code: int) -> bytes:
    return sse({"error": {"message": message, "type": etype, "param": None, "code": code}})


async def data_lines(resp, deadline: float) -> AsyncIterator[str]:
    """The data of each server-sent event of a decode's streamed answer, until the event loop's
    time ``deadline`` (--decode-timeout holds the whole answer): asyncio.TimeoutError past it."""
    lines = resp.aiter_lines()
    while True:
        line = await _before(anext(lines, None), deadline)
        if line is None:
            return
        if line.startswith("data:"):
            yield line[5:].strip()


if sys.version_info >= (3, 11):
    async def _before(awaitable, deadline: float):
        async with asyncio.timeout_at(deadline):  # (no task per awaited line, as wait_for makes)
            return await awaitable
else:  # Python 3.10
    async def _before(awaitable, deadline: float):
        return await asyncio.wait_for(awaitable, max(0.0, deadline - asyncio.get_running_loop().time()))


def decode_failure(url: str, status: int, content: bytes) -> DecodeFailed:
    """A decode's 5xx for a request it was sent with our KV, said as ours (502) with what to check:
    a decode that cannot read this server's KV (its NIXL compatibility hash differs: another dtype,
    block size or attention backend) answers every request so, and only its log says why."""
    try:
        said = json.loads(content).get("error", {}).get("message") or ""
    except (ValueError, AttributeError):
        said = content[:200].decode(errors="replace")
    msg = (f"the decode at {url} failed this request (HTTP {status}: {said.strip() or 'no message'}). If it "
           "fails every request and its log says 'compatibility hash mismatch', it cannot read this server's "
           "KV: start this server with the decode's --dtype and --decode-attn-backend (and --block-size)")
    log.warning("%s", msg)
    return DecodeFailed(msg)


async def raise_prefill_failure(prefill) -> None:
    """Connector mode (``prefill``: the streamed prefill's future; None otherwise): when the decode
    failed, the prefill's reason says more than its 500."""
    if prefill is None:
        return
    await asyncio.wait([prefill], timeout=2.0)
    if prefill.done() and not prefill.cancelled() and (e := prefill.exception()) is not None:
        if isinstance(e, PrefillError):
            raise e
        raise PrefillError(f"the prefill failed ({type(e).__name__}: {e}); the decode could not use its KV") from e


def renamer(decode_model: str, served: str) -> Callable[[bytes], bytes]:
    """The rewrite of the decode's JSON (an answer, or each event of a stream) that names the model as
    clients name it here (``--served-model-name``), as vLLM alone would: its ``"model":"<id>"`` pair
    replaced (vLLM writes JSON without spaces, in UTF-8; a quote inside any string value is escaped, so
    only that pair matches). Nothing to do when the names agree."""
    if not decode_model or decode_model == served:
        return lambda raw: raw
    old, new = (b'"model":' + json.dumps(n, ensure_ascii=False).encode() for n in (decode_model, served))
    return lambda raw: raw.replace(old, new)


def consume(fut) -> None:
    """Retrieve a background prefill's exception so asyncio does not log it as unhandled."""
    if not fut.cancelled() and fut.exception() is not None:
        log.info("streamed prefill ended with %s", type(fut.exception()).__name__)


async def streamed_cached_tokens(prefill: asyncio.Future, wait_s: float = 2.0) -> int | None:
    """A streamed prefill's prefix-cache hit, for the answer's usage. The decode answers once every
    layer reached it, so the prefill has (nearly always) ended; None if it has not within ``wait_s``
    or failed (the answer then carries the decode's own usage)."""
    await asyncio.wait([prefill], timeout=wait_s)
    return ended_cached_tokens(prefill)


def ended_cached_tokens(prefill: asyncio.Future) -> int | None:
    """A streamed prefill's prefix-cache hit if it has ended well; None otherwise."""
    if not prefill.done() or prefill.cancelled() or prefill.exception() is not None:
        return None
    return prefill.result().num_cached_tokens


def check_prompt_tokens(body, n: int, rid: str) -> None:
    """The decode must have used exactly our tokens (``body``: its answer, parsed). A different count
    means its prompt is not the one our KV was made for, so its answer rests on another prompt's KV:
    ``PromptMismatch`` instead of that answer."""
    try:
        used = body.get("usage", {}).get("prompt_tokens")
    except Exception:
        return
    if isinstance(used, int) and used != n:
        log.error("request %s: decode counted %s prompt tokens, the prefill %d: answer withheld", rid, used, n)
        raise PromptMismatch(f"the decode read this request as {used} prompt tokens, the prefill as {n}, so the "
                             "decode's answer would rest on the KV of another prompt and is withheld. This "
                             "server's tokenizer or chat rendering differ from the decode's for this request: "
                             "report it with the request body; --tokenizer-parity decode tokenizes every "
                             "request at the decode")


def one_token_answer(service: PrefillService, chat: bool, r: PrefillResult, prompt_ids: list[int],
                      kv_transfer_params: dict | None = None) -> pi.PrefillAnswer:
    """The answer of a prefill alone: its first token (with kv_transfer_params for a PD router)."""
    eos = r.first_token_id in service.eos_token_ids
    text = "" if eos else service.tokenizer.continuation_text(prompt_ids, r.first_token_id) or ""
    return pi.PrefillAnswer(chat, r.request_id, service.info.served_name, text, "stop" if eos else "length",
                            r.num_prompt_tokens, r.num_cached_tokens, kv_transfer_params)

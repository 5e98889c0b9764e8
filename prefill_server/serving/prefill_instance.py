"""Answering as a vLLM *prefill instance* behind a PD router (vllm-router, vLLM's proxy, llm-d).

A router sends the prefill the client's request plus ``kv_transfer_params: {"do_remote_decode":
true, ...}`` and ``max_tokens: 1``; the prefill computes the prompt, keeps its KV under a lease and
answers at once with one token, ``usage`` and the top-level ``kv_transfer_params`` that the router
copies verbatim into its decode's request (a stream carries them on its last chunk, as vLLM 0.33
does). The decode then pulls the blocks over NIXL and frees them with its notification; a router
that never forwards them lets the lease expire (``--lease-ttl``), as with a stock vLLM prefill.

This module reads a request's ``kv_transfer_params`` and builds the answer; the gateway runs the
prefill (``gateway.py``).
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from prefill_server.errors import InvalidRequest

_PARAMS = "kv_transfer_params"
# fields a router may send the prefill (all null from vllm-router, vLLM's proxy and llm-d) and
# the JSON types they may take
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "do_remote_decode": (bool,), "do_remote_prefill": (bool,), "remote_engine_id": (str,),
    "remote_request_id": (str,), "remote_block_ids": (list,), "remote_host": (str,), "remote_port": (int,),
    "tp_size": (int,), "dcp_size": (int,), "pp_size": (int,), "remote_num_tokens": (int,),
    "remote_blocks_expiry_time": (int, float), "transfer_mode": (str,),
    "remote_prefill_cached_tokens": (int,), "remote_registration_generation": (int,),
}
_JSON_NAMES = {bool: "a boolean", str: "a string", list: "an array", int: "an integer", float: "a number"}


def wants_remote_decode(raw: dict) -> bool:
    """Whether the request asks for a prefill instance's answer (``do_remote_decode`` true). Its
    ``kv_transfer_params`` are checked: a malformed one is refused with the field it concerns."""
    params = raw.get(_PARAMS)
    if params is None:
        return False
    if not isinstance(params, dict):
        raise InvalidRequest(f"'{_PARAMS}' must be an object such as {{\"do_remote_decode\": true}} (what a PD "
                             "router sends its prefill), not a " + type(params).__name__, field=_PARAMS)
    for key, types in _FIELD_TYPES.items():
        v = params.get(key)
        if v is None:
            continue
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
            want = " or ".join(_JSON_NAMES[t] for t in types)
            raise InvalidRequest(f"'{_PARAMS}.{key}' must be {want} or null, not {json.dumps(v)[:40]}",
                                 field=f"{_PARAMS}.{key}")
    if params.get("do_remote_prefill"):
        raise InvalidRequest(f"'{_PARAMS}.do_remote_prefill' is true: that asks to load KV computed elsewhere, "
                             "which a decode does; this server is the prefill: send it do_remote_decode=true "
                             "(or no kv_transfer_params)", field=f"{_PARAMS}.do_remote_prefill")
    return params.get("do_remote_decode") is True


@dataclass(frozen=True)
class PrefillAnswer:
    """A prefill's one-token answer: what a prefill instance tells the router about one request
    (``kv_transfer_params`` set), or a server without a decode tells its client (None)."""

    chat: bool
    request_id: str
    model: str
    text: str  # the one token, as text
    finish_reason: str  # "length", or "stop" when the token ends the answer
    num_prompt_tokens: int
    cached_tokens: int
    kv_transfer_params: dict | None
    created: int = 0

    def usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": 1,
                "total_tokens": self.num_prompt_tokens + 1,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def _head(self) -> dict:
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.request_id,
                "created": self.created or int(time.time()), "model": self.model}

    def body(self) -> dict:
        """The whole answer (``stream: false``)."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                      "logprobs": None, "finish_reason": self.finish_reason, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text, "logprobs": None, "finish_reason": self.finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
            obj = "text_completion"
        out = {**self._head(), "object": obj, "choices": [choice], "usage": self.usage()}
        if self.kv_transfer_params is not None:
            out[_PARAMS] = self.kv_transfer_params
        return out

    def chunks(self, include_usage: bool) -> list[dict]:
        """The answer as stream chunks: the token, then the finish with ``kv_transfer_params``
        (then ``usage`` when asked for)."""
        head = {**self._head(), "object": "chat.completion.chunk" if self.chat else "text_completion"}
        if self.chat:
            out = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]},
                   {**head, "choices": [{"index": 0, "delta": {"content": self.text}, "logprobs": None,
                                         "finish_reason": None}]},
                   {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                         "finish_reason": self.finish_reason}], _PARAMS: self.kv_transfer_params}]
        else:
            out = [{**head, "choices": [{"index": 0, "text": self.text, "logprobs": None, "finish_reason": None}]},
                   {**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                         "finish_reason": self.finish_reason}], _PARAMS: self.kv_transfer_params}]
        if include_usage:
            out.append({**head, "choices": [], "usage": self.usage()})
        return out


async def events(chunks: list[dict], on_end: Callable[[bool], None]) -> AsyncIterator[bytes]:
    """Server-sent events of ``chunks`` and ``[DONE]``; ``on_end(sent)`` once it ends, ``sent``
    whether the chunk with the ``kv_transfer_params`` was sent (a yield resumes only after the
    server has sent what it handed over; a client gone makes it raise there instead)."""
    sent = False
    try:
        for c in chunks:
            yield b"data: " + json.dumps(c).encode() + b"\n\n"
            sent = sent or _PARAMS in c
        yield b"data: [DONE]\n\n"
    finally:
        on_end(sent)

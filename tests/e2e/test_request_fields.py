"""The same odd request to vLLM alone and through this server in front of the same vLLM decode
(nixl-compat, fp32): what vLLM answers, this server answers; what vLLM refuses (4xx), this server
refuses, naming the field, before any prefill; what vLLM fails with a 5xx or a dropped connection
(its own bugs, e.g. a ``structured_outputs`` that is not an object), this server refuses with a 400.
Each field gets values of the right kind, of a kind vLLM's request classes read leniently ("5", 1 for
true) and of the wrong kind; every block is back in the pool afterwards."""
from __future__ import annotations

import httpx
import pytest


pytestmark = pytest.mark.e2e

ODD = [None, -1, 0, 1.5, "x", [], {}, True, 1e30, "", [1, 2], {"a": 1}, "5", 5]
COMMON = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
          "presence_penalty", "repetition_penalty", "logprobs", "stream", "ignore_eos", "min_tokens",
          "skip_special_tokens", "include_stop_str_in_output", "response_format", "structured_outputs", "user",
          "priority", "request_id", "return_token_ids", "vllm_xargs", "model", "allowed_token_ids"]
CHAT = ["top_logprobs", "tools", "tool_choice", "add_generation_prompt", "echo", "parallel_tool_calls",
        "reasoning_effort", "max_completion_tokens"]
COMPLETION = ["echo", "add_special_tokens"]


def _cases():
    for path, base, fields in (
            ("/v1/completions", {"prompt": "The capital of France is"}, COMMON + COMPLETION),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, COMMON + CHAT)):
        for field in fields:
            for value in ODD:
                yield path, {**base, "max_tokens": 2, "temperature": 0, field: value}, field, value


def _status(client: httpx.Client, url: str, path: str, body: dict) -> tuple[int | None, str]:
    for attempt in range(2):  # (a kept-alive connection vLLM closed after its last error: once more)
        try:
            r = client.post(url + path, json=body)
            return r.status_code, r.text[:300]
        except httpx.TransportError as e:  # (vLLM drops the connection on some of its own bugs)
            why = repr(e)
    return None, why


def test_odd_fields_are_answered_or_refused_as_vllm_does(vllm_decode, gateway):
    wrong = []
    with httpx.Client(timeout=120) as client:
        for path, body, field, value in _cases():
            if field == "n" and value in (5, "5"):
                continue  # several choices: refused here on purpose (test_sampling_checks.py)
            theirs, why = _status(client, vllm_decode.url, path, body)
            ours, text = _status(client, gateway.url, path, body)
            if theirs is None or theirs >= 500:  # vLLM's own failure: a clear refusal here
                ok = ours is not None and 400 <= ours < 500
            else:
                ok = ours is not None and ours // 100 == theirs // 100
            if ours is not None and 400 <= ours < 500 and ok:  # refused here (not by the decode), naming it
                ok = field in text and ('"type":"BadRequestError"' not in text or "max allowed" in text)
                # (the decode's own limit, its --max-logprobs, stays the decode's to say)
            if not ok:
                wrong.append((path, field, value, theirs, ours, why[:120], text[:160]))
    assert not wrong, "\n".join(map(repr, wrong))
    assert gateway.wait_pool_empty() == 0

"""Streamed answers checked as whole ones are (serving/stream_relay.py): the decode is always asked
for usage on every chunk, a decode that counted another prompt gives PromptMismatch (an HTTP error
while nothing was sent, else an error event after t1), and the client gets the usage it asked for,
where vLLM alone puts it. "vLLM alone" here is vLLM 0.32's own stream generators
(``vllm_serving_reference.py streams``, run in .venv-vllm); the decode is tests/serving/fake_decode.py,
itself checked against them first. The engine runs the embedded SmolLM2 (transfer mode local)."""
from __future__ import annotations

import json

import httpx
import pytest

from fake_decode import FakeDecode
from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.serving.background import BackgroundServer
from prefill_server.serving.decode_client import DecodeClient
from prefill_server.serving.http import create_app
from prefill_server.serving.openai_schema import usage_asked
from prefill_server.serving.server import build_service
from prefill_server.serving.stream_relay import DECODE_STREAM_OPTIONS, StreamUsage
from test_gateway_robustness import counter, wait_for
from vllm_serving_reference import ask

OPTIONS = [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}]
KINDS = ["completion", "chat"]
TOKENS = 3  # the fake decode's answer: " ok" three times, then finish_reason "length"
REF_PROMPT = 7  # the prompt length vLLM's generators are given (usage is compared less the prompt)


@pytest.fixture(scope="module")
def vllm_streams():
    """vLLM's own events, by (kind, stream_options index, number of tokens): 3 tokens, the decode's
    answer alone; 4, t1 ("T1") and the decode's."""
    cases = [(k, i, n) for k in KINDS for i in range(len(OPTIONS)) for n in (TOKENS, TOKENS + 1)]
    got = ask("streams", [{"endpoint": k, "body": {"stream_options": OPTIONS[i]} if OPTIONS[i] else {},
                           "prompt_tokens": REF_PROMPT, "texts": (["T1"] if n > TOKENS else []) + [" ok"] * TOKENS,
                           "finish_reason": "length"} for k, i, n in cases])
    return {case: [e if e == "[DONE]" else json.loads(e) for e in events] for case, events in zip(cases, got)}


@pytest.fixture(scope="module")
def stack():
    """(service, fake decode, gateway url). Leases outlive the module (the fake decode never reads
    the KV): the tests release what a decode would have read, so a KV left held is seen."""
    svc = build_service(EngineConfig(dtype="float32", num_kv_blocks=64, block_size=16, token_budget=256,
                                     lease_ttl_s=600.0), ServerConfig(transfer_mode="local", first_token="prefill"))
    svc.worker.engine.start()
    try:
        with FakeDecode(tokens=TOKENS) as decode, BackgroundServer(create_app(svc, DecodeClient(decode.url))) as gw:
            yield svc, decode, gw.url
    finally:
        svc.worker.engine.stop()


def _body(kind: str, ahead: bool, so: dict | None) -> dict:
    """A streamed request; ``ahead``: greedy, so t1 comes from the prefill (else the decode samples it)."""
    body = {"prompt": "The sea is"} if kind == "completion" else {"messages": [{"role": "user", "content": "Hi"}]}
    body |= {"max_tokens": TOKENS + 1, "stream": True} | ({"temperature": 0} if ahead else {})
    return body | ({"stream_options": so} if so is not None else {})


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def _stream(url: str, kind: str, body: dict) -> tuple[int, list, bytes]:
    """(status, events: parsed, "[DONE]" as it came, raw bytes)."""
    with httpx.stream("POST", url + _path(kind), json=body, timeout=60) as r:
        raw = r.read()
    if r.status_code != 200:
        return r.status_code, [r.json()], raw
    data = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    return 200, [d if d == "[DONE]" else json.loads(d) for d in data], raw


def _sent(decode: FakeDecode) -> tuple[dict, int]:
    """The decode's last request and the prompt length the prefill counted for it."""
    req = decode.requests[-1]
    return req, req["kv_transfer_params"]["num_tokens"]  # (transfer mode local's params name it)


def _less_prompt(u: dict, n: int) -> dict:
    """Usage less the prompt: what is compared with vLLM's (whose prompt differs in length)."""
    return {**u, "prompt_tokens": u["prompt_tokens"] - n, "total_tokens": u["total_tokens"] - n}


def _same_shape(ev, n: int):
    """An event with what differs between any two vLLM answers set aside (id, time, model name,
    fingerprint value, prompt length)."""
    if not isinstance(ev, dict):
        return ev
    out = {**ev, "id": "ID", "created": 0, "model": "M"}
    if "system_fingerprint" in ev:
        out["system_fingerprint"] = "FP"
    if "usage" in ev:  # (the prefix cache's hit, which this server adds, is checked apart)
        out["usage"] = _less_prompt({k: v for k, v in ev["usage"].items() if k != "prompt_tokens_details"}, n)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("so", range(len(OPTIONS)))
def test_the_fake_decode_streams_as_vllm_does(vllm_streams, kind, so):
    """Each stream_options case: the same events, usage and system_fingerprint in the same places."""
    with FakeDecode(tokens=TOKENS) as d:
        body = {"prompt": list(range(5)), "stream": True} if kind == "completion" else \
            {"messages": [{"role": "user", "content": "x"}], "stream": True, "kv_transfer_params": {"num_tokens": 5}}
        _, events, raw = _stream(d.url, kind, body | ({"stream_options": OPTIONS[so]} if OPTIONS[so] else {}))
    assert [_same_shape(e, 5) for e in events] == [_same_shape(e, REF_PROMPT) for e in vllm_streams[kind, so, TOKENS]]
    assert b", " not in raw and b'": ' not in raw  # (compact, as vLLM writes it)


def _release_as_the_decode_would(svc, req: dict) -> None:
    svc.release(req["kv_transfer_params"]["request_id"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("so", range(len(OPTIONS)))
def test_a_relayed_stream_has_the_usage_the_client_asked_for(stack, vllm_streams, kind, so):
    """t1 sampled by the decode: the decode is asked for usage on every chunk, and the client gets
    vLLM alone's events for its own stream_options, byte for byte where nothing was cut."""
    svc, decode, url = stack
    status, events, raw = _stream(url, kind, _body(kind, False, OPTIONS[so]))
    req, n = _sent(decode)
    _release_as_the_decode_would(svc, req)
    assert status == 200, events
    assert req["stream_options"] == DECODE_STREAM_OPTIONS and ("messages" in req) == (kind == "chat")
    assert [_same_shape(e, n) for e in events] == [_same_shape(e, REF_PROMPT) for e in vllm_streams[kind, so, TOKENS]]
    assert b", " not in raw  # (events edited here are written compactly, as vLLM writes them)
    usages = [e["usage"] for e in events if isinstance(e, dict) and "usage" in e]
    assert all(u["prompt_tokens_details"]["cached_tokens"] >= 0 for u in usages)  # (as whole answers say it)


def _t1_as_reference(events: list) -> list:
    """Our events with t1's text (the first non-empty text: the prefill's token) set to the
    reference's "T1"."""
    for e in events:
        for c in e["choices"] if isinstance(e, dict) else ():
            key, holder = ("content", c["delta"]) if "delta" in c else ("text", c)
            if holder.get(key):
                holder[key] = "T1"
                return events
    raise AssertionError(f"no t1 in {events}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("so", range(len(OPTIONS)))
def test_t1_ahead_has_the_usage_the_client_asked_for(stack, vllm_streams, kind, so):
    """t1 from the prefill, then the decode's completion of prompt + [t1]: vLLM alone's events,
    null fields included, t1 counted as completion, the prefix cache's cached_tokens on each usage."""
    svc, decode, url = stack
    status, events, _ = _stream(url, kind, _body(kind, True, OPTIONS[so]))
    req, n = _sent(decode)
    _release_as_the_decode_would(svc, req)
    assert status == 200, events
    assert len(req.get("prompt", ())) == n + 1 and req["stream_options"] == DECODE_STREAM_OPTIONS  # prompt + [t1]
    ours = [_same_shape(e, n) for e in _t1_as_reference(events)]
    assert ours == [_same_shape(e, REF_PROMPT) for e in vllm_streams[kind, so, TOKENS + 1]]  # (null fields too)
    usages = [e["usage"] for e in events if isinstance(e, dict) and "usage" in e]
    assert all(u["prompt_tokens"] == n and u["prompt_tokens_details"]["cached_tokens"] >= 0 for u in usages)


def test_stream_options_are_read_as_vllm_reads_them():
    """Lax booleans, as vLLM's StreamOptions takes them: what it refuses is not read (None)."""
    cases = [{}, {"include_usage": True}, {"include_usage": "yes", "continuous_usage_stats": 1},
             {"include_usage": "maybe"}, {"include_usage": 2}, {"include_usage": None, "x": 1},
             {"continuous_usage_stats": "off"}]
    got = ask("bodies", [{"endpoint": "completion", "body": {"prompt": "x", "stream": True, "stream_options": so}}
                         for so in cases])
    assert [usage_asked(so) is not None for so in cases] == [g["ok"] for g in got]
    assert usage_asked({"include_usage": "yes", "continuous_usage_stats": 1}) == (True, True)
    assert usage_asked({"continuous_usage_stats": True}) == (False, False)  # (only with include_usage)


def test_stream_options_vllm_would_refuse_reach_the_decode_as_they_are(stack):
    """Asked for nothing then: the decode refuses them as it would have (this fake one answers)."""
    svc, decode, url = stack
    so = {"include_usage": "maybe"}
    status, _, _ = _stream(url, "completion", _body("completion", False, so))
    req, _ = _sent(decode)
    _release_as_the_decode_would(svc, req)
    assert status == 200 and req["stream_options"] == so


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ahead", [False, True])
def test_a_decode_counting_another_prompt_gives_prompt_mismatch_and_frees_the_kv(stack, kind, ahead):
    """Nothing sent yet: the HTTP 502 a whole answer gets. t1 already sent: an error event of type
    PromptMismatch, then [DONE], and none of the decode's answer. Either way the KV is freed."""
    svc, decode, url = stack
    assert wait_for(lambda: svc.worker.engine.pool.num_used == 0, 5.0)
    before = counter(svc, "requests", "PromptMismatch")
    decode.miscount = 1
    try:
        status, events, _ = _stream(url, kind, _body(kind, ahead, None))
    finally:
        decode.miscount = 0
    if not ahead:
        assert status == 502 and events[0]["error"]["type"] == "PromptMismatch", events
        assert "withheld" in events[0]["error"]["message"]
    else:
        assert status == 200 and events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["type"] == "PromptMismatch" and err["code"] == 502 and "withheld" in err["message"]
        text = "".join(c.get("text") or c.get("delta", {}).get("content") or ""
                       for e in events[:-2] for c in e["choices"])
        assert text and " ok" not in text  # t1 alone
    assert wait_for(lambda: svc.worker.engine.pool.num_used == 0, 5.0), "the KV was left held"
    assert wait_for(lambda: counter(svc, "requests", "PromptMismatch") == before + 1, 5.0)


def test_finishing_chunks_held_for_the_fingerprint_go_out_when_the_stream_ends_without_it():
    """A stream cut after the finishing chunk (no usage chunk): that chunk still reaches the client."""
    u = StreamUsage(False, False, 5, "r")
    first = '{"choices":[{"index":0,"text":" a","finish_reason":null}],"usage":{"prompt_tokens":5}}'
    assert u.feed(first) == [{"choices": [{"index": 0, "text": " a", "finish_reason": None}]}]
    assert u.feed('{"choices":[{"index":0,"text":" b","finish_reason":"length"}],"usage":{"prompt_tokens":5}}') == []
    assert u.flush() == [{"choices": [{"index": 0, "text": " b", "finish_reason": "length"}]}] and u.flush() == []

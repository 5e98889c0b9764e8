"""A new user's first day against a real vLLM 0.32 decode (nixl-compat, fp32): a client that hangs
up cancels its prefill and never reaches the decode, or aborts the decode's answer; limits come from
the decode (its --max-model-len 4096 < the model's 8192); --dtype auto follows it; a prefill started
before its decode waits for it; a decode killed mid-answer gives the client an error, readiness
follows it and requests fail fast; SIGTERM drains and exits cleanly; a streamed answer has the
usage its client asked for, where vLLM alone puts it. (The block-boundary sweep is
test_block_boundaries.py.)"""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from prompts import all_prompts
from prefill_server.local_vllm import VllmDecode, free_port

pytestmark = pytest.mark.e2e
EXE = str(pathlib.Path(sys.executable).parent / "prefill-server")


def metric(url: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(m.group(1)) if m else 0.0


def decode_requests(decode: VllmDecode) -> float:
    """Requests the decode has received (vLLM counts every prompt it admits)."""
    text = httpx.get(decode.url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def test_dtype_auto_is_the_decodes(vllm_decode, gateway):
    assert str(gateway.service.worker.engine.pool.dtype) == f"torch.{vllm_decode.dtype}" == "torch.float32"


def test_client_gone_mid_prefill_is_cancelled_and_never_forwarded(vllm_decode, gateway):
    long = max((p for p in all_prompts() if p.kind == "plain"), key=lambda p: p.approx_tokens)
    url = gateway.url
    seen = decode_requests(vllm_decode)
    cancelled = metric(url, "prefill_server:prefills_total", '{outcome="RequestCancelled"}')
    with pytest.raises(httpx.ReadTimeout):  # ~3K tokens in steps of 256: seconds of prefill
        httpx.post(url + "/v1/completions", json={"prompt": long.text, "max_tokens": 8, "temperature": 0},
                   timeout=1.0)
    deadline = time.monotonic() + 10
    while metric(url, "prefill_server:prefills_total", '{outcome="RequestCancelled"}') == cancelled:
        assert time.monotonic() < deadline, "the prefill ran on after its client had gone"
        time.sleep(0.1)
    assert gateway.wait_pool_empty() == 0
    assert metric(url, "prefill_server:requests_total", '{outcome="cancelled"}') >= 1
    time.sleep(1.0)
    assert decode_requests(vllm_decode) == seen, "a cancelled request reached the decode"


def running(decode: VllmDecode) -> float:
    text = httpx.get(decode.url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M))


def test_client_gone_mid_answer_aborts_the_decode(vllm_decode, gateway):
    with httpx.stream("POST", gateway.url + "/v1/completions", timeout=120,
                      json={"prompt": "The sea is", "max_tokens": 2000, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # hang up after a few events
        assert running(vllm_decode) == 1
    deadline = time.monotonic() + 20
    while running(vllm_decode) > 0:
        assert time.monotonic() < deadline, "the decode kept generating for a client that had gone"
        time.sleep(0.2)
    assert gateway.wait_pool_empty() == 0
    assert metric(gateway.url, "prefill_server:requests_total", '{outcome="cancelled"}') >= 1
    assert httpx.post(gateway.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                      timeout=120).status_code == 200


def _same_chat_answer(gateway, vllm_decode, body: dict) -> tuple[dict, dict]:
    """The chat through the pipeline and from the decode alone: both 200, the same prompt count and
    answer text; returns (ours, theirs)."""
    ours = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120)
    theirs = httpx.post(vllm_decode.url + "/v1/chat/completions", json={**body, "model": vllm_decode.model},
                        timeout=120)
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    a, b = ours.json(), theirs.json()
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    return a, b


@pytest.mark.parametrize("fields,last", [
    ({"add_generation_prompt": False}, None),
    ({"add_generation_prompt": False, "continue_final_message": True}, "The sea is"),
    ({"add_special_tokens": True, "chat_template_kwargs": {"custom_var": 1}}, None),
])
def test_chat_rendering_fields_give_the_decodes_own_answer(vllm_decode, gateway, fields, last):
    """The decode renders the chat body itself: fields that change its rendering must change ours the
    same way, or it would continue from KV of another prompt (a 32-token prompt, exactly one of the
    decode's blocks, gave it garbage)."""
    msgs = [{"role": "user", "content": "Write a poem about the sea"}]
    msgs += [{"role": "assistant", "content": last}] if last else []
    body = {"messages": msgs, "max_tokens": 10, "temperature": 0, **fields}
    _same_chat_answer(gateway, vllm_decode, body)
    assert gateway.wait_pool_empty() == 0


def _keys(x, prefix=""):
    if isinstance(x, list):
        return _keys(x[0], prefix + "[0]") if x else set()
    return {k for key, v in x.items() for k in (prefix + "." + key, *_keys(v, prefix + "." + key))} \
        if isinstance(x, dict) else set()


def test_developer_messages_and_the_answers_fields_are_the_decodes(vllm_decode, gateway):
    """A developer message renders as vLLM renders it for SmolLM2's template (as system); the answer,
    its first token ours, has every field of vLLM's own."""
    body = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
            "max_tokens": 8, "temperature": 0}
    a, b = _same_chat_answer(gateway, vllm_decode, body)
    assert _keys(b) <= _keys(a), _keys(b) - _keys(a)
    assert gateway.wait_pool_empty() == 0


def test_a_cache_salt_reaches_the_decode_and_isolates_our_prefix_cache(vllm_decode, gateway):
    """vLLM's cache_salt: the decode takes it with the rest of the request (its answer is vLLM alone's,
    the first token ours), and our prefix cache serves a salted prompt only to the same salt."""
    poem = "Write a long poem about the sea, its tides, its storms and the boats that cross it. " * 3
    body = {"messages": [{"role": "user", "content": poem}], "max_tokens": 8, "temperature": 0}

    def cached(salt: str) -> int:
        a, _ = _same_chat_answer(gateway, vllm_decode, {**body, "cache_salt": salt})
        return a["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # another tenant's salt: none of tenant-a's blocks
    assert cached("tenant-a") > 0
    bad = httpx.post(gateway.url + "/v1/chat/completions", json={**body, "cache_salt": "a/b"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
    assert gateway.wait_pool_empty() == 0


def test_limits_are_the_decodes(vllm_decode, gateway):
    """The model has 8192 positions; the decode runs --max-model-len 4096: that is the limit."""
    m = httpx.get(gateway.url + "/v1/models").json()["data"][0]
    assert m["max_model_len"] == vllm_decode.max_model_len == 4096
    t0 = time.monotonic()
    r = httpx.post(gateway.url + "/v1/completions", json={"prompt": [100] * 5001, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and "--max-model-len" in r.json()["error"]["message"]
    r = httpx.post(gateway.url + "/v1/completions", json={"prompt": [100] * 4000, "max_tokens": 200}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert time.monotonic() - t0 < 5, "refused only after computing"
    assert gateway.wait_pool_empty() == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "The history of the sea is"}),  # vLLM's completion default: 16 tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say ok."}]}),  # a chat's: the context
])
def test_a_greedy_answer_without_max_tokens_is_as_long_as_vllm_alones(vllm_decode, gateway, path, body):
    """t1 comes from the prefill and the decode is asked for the rest as a completion, whose own
    default (16) must not cut a chat short nor add t1 to a completion's 16."""
    body = body | {"temperature": 0}
    ahead = metric(gateway.url, "prefill_server:first_token_total", '{sampled_by="prefill"}')
    ours = httpx.post(gateway.url + path, json=body, timeout=300).json()
    theirs = httpx.post(vllm_decode.url + path, json={**body, "model": vllm_decode.model}, timeout=300).json()
    assert metric(gateway.url, "prefill_server:first_token_total", '{sampled_by="prefill"}') == ahead + 1
    for answer in (ours, theirs):
        c = answer["choices"][0]
        answer["seen"] = (c.get("text") or c["message"]["content"], c["finish_reason"],
                          answer["usage"]["completion_tokens"])
    assert ours["seen"] == theirs["seen"]
    assert gateway.wait_pool_empty() == 0


def _stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _where_usage_goes(events: list[dict]) -> list[tuple]:
    """Per event: its fields and its choices' (null ones included), its choices' finish reasons, its
    usage (less the prefix cache's cached_tokens, which this server adds) and its system_fingerprint;
    then the whole text."""
    shape = [(sorted(e), [sorted(c) + sorted(c.get("delta", ())) for c in e["choices"]],
              [c.get("finish_reason") for c in e["choices"]], e.get("usage") and
              {k: v for k, v in e["usage"].items() if k != "prompt_tokens_details"}, e.get("system_fingerprint"))
             for e in events]
    text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e["choices"])
    return shape + [text]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stream_has_the_usage_its_client_asked_for(vllm_decode, gateway, kind):
    """The decode is always asked for usage on every chunk (its prompt count is checked on the
    first), yet each stream_options case gets vLLM alone's events: per-chunk usage only with
    continuous_usage_stats, the last usage chunk only with include_usage, the fingerprint where vLLM
    puts it; t1 from the prefill (greedy) or from the decode (min_tokens takes the ordinary way)."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    base = {"messages": [{"role": "user", "content": "Name a colour."}]} if kind == "chat" else {"prompt": "The sea is"}
    url = gateway.url
    ahead, not_ahead = (metric(url, "prefill_server:first_token_total", f'{{sampled_by="{who}"}}')
                        for who in ("prefill", "decode"))
    for so in (None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}):
        for extra in ({}, {"min_tokens": 0}):
            body = base | {"max_tokens": 6, "temperature": 0, "stream": True} | extra | \
                ({"stream_options": so} if so else {})
            ours = _where_usage_goes(_stream(url, path, body))
            theirs = _where_usage_goes(_stream(vllm_decode.url, path, {**body, "model": vllm_decode.model}))
            assert ours == theirs, (so, extra)
    assert metric(url, "prefill_server:first_token_total", '{sampled_by="prefill"}') == ahead + 3
    assert metric(url, "prefill_server:first_token_total", '{sampled_by="decode"}') == not_ahead + 3
    assert gateway.wait_pool_empty() == 0


def test_prefill_started_before_its_decode_then_the_decode_dies(decode_model_dir, tmp_path):
    """The prefill waits for a decode still starting; a decode killed mid-answer gives the client an
    error (the SDK raises), readiness and gRPC health follow it, requests fail fast; SIGTERM exits 0."""
    port = free_port()
    log = tmp_path / "serve.log"
    server = subprocess.Popen([EXE, "serve", "--model", str(decode_model_dir), "--port", "0", "--grpc-port", "0",
                               "--decode-url", f"http://127.0.0.1:{port}", "--decode-wait", "900",
                               "--decode-health-interval", "1", "--kv-cache-gib", "0.1"],
                              stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True)
    decode = VllmDecode(model=str(decode_model_dir), log_path=tmp_path / "vllm-decode.log", port=port)
    try:
        deadline = time.monotonic() + 60  # (start-up imports take 5+ s on a busy 2-core box)
        while "decode not ready" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        with decode:
            server.stdout.readline()  # the gRPC line
            url = re.search(r"listening on (http://\S+)", server.stdout.readline()).group(1)
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
            assert client.completions.create(model=decode.served_model_name(), prompt="The sea is",
                                             max_tokens=4, temperature=0).choices[0].text
            got = []
            with pytest.raises(openai.APIError):
                for i, chunk in enumerate(client.completions.create(
                        model=decode.served_model_name(), prompt="The sea is", max_tokens=2000, temperature=0,
                        stream=True, extra_body={"ignore_eos": True})):
                    got.append(chunk.choices[0].text)
                    if i == 3:
                        os.killpg(os.getpgid(decode.proc.pid), signal.SIGKILL)
            assert 4 <= len(got) < 2000
        deadline = time.monotonic() + 15
        while httpx.get(url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "readiness still ok with the decode dead"
            time.sleep(0.2)
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": "The sea is", "max_tokens": 4}, timeout=60)
        assert r.status_code == 503 and time.monotonic() - t0 < 1.0, r.text
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        text = log.read_text()
        assert "SIGTERM received" in text and "stopped:" in text and "Traceback" not in text
    finally:
        if server.poll() is None:
            server.kill()

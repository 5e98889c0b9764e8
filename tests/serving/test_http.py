"""Gateway behaviour on good and bad input, with the real model in transfer mode 'local'."""
import json
import socket

import pytest
from fastapi.testclient import TestClient

from prefill_server.serving.http import create_app
from prefill_server.serving.auth import ApiKeys, load_api_key
from prefill_server.serving.decode_client import DecodeClient


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def client(local_service):
    with TestClient(create_app(local_service, None)) as c:
        yield c
    assert local_service.worker.engine.pool.num_used == 0


def test_completion_and_chat_return_first_token(client, local_service):
    r = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["text"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi!"}],
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 5


def test_models_health_metrics(client, local_service):
    assert client.get("/health").json() == {"status": "ok"}
    m = client.get("/v1/models").json()["data"][0]
    assert m["id"] == local_service.info.served_name
    client.post("/v1/completions", json={"prompt": "Hello", "temperature": 0})
    text = client.get("/metrics").text
    for name in ("prefill_server:time_to_first_token_seconds", "prefill_server:kv_blocks_in_use",
                 "prefill_server:kv_transfer_bytes_total", "prefill_server:kv_lease_expired_total",
                 "prefill_server:num_requests_waiting", "prefill_server:prefill_seconds"):
        assert name in text


@pytest.mark.parametrize("body,status,needle", [
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": "hi", "model": "no-such-model"}, 404, "not served here"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": ["a", "b"]}, 400, "one prompt"),
    ({"prompt": [1, 2, 10**9]}, 400, "vocabulary"),
    ({"prompt": [1] * 9000}, 400, "context"),
    ({}, 400, "prompt"),
    ({"prompt": "hi", "suffix": " end"}, 400, "suffix"),  # (vLLM: FIM models only)
    ({"prompt": "hi", "suffix": ""}, 400, "suffix"),
    ({"prompt_embeds": "AAAA"}, 400, "prompt_embeds"),  # (never another prompt's KV)
    ({"prompt": "hi", "prompt_embeds": ["AAAA"]}, 400, "prompt_embeds"),
])
def test_bad_completion_input_gets_4xx(client, body, status, needle):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "still serving"}).status_code == 200


def test_null_suffix_and_empty_prompt_embeds_are_absent_as_in_vllm(client):
    for extra in ({"suffix": None}, {"prompt_embeds": None}, {"prompt_embeds": []}):
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **extra})
        assert r.status_code == 200, (extra, r.text)


@pytest.mark.parametrize("raw,needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": 5, "content": "x"}]}', "role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "content"),
])
def test_bad_chat_input_gets_400(client, raw, needle):
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_chat_rendering_fields_are_the_decodes(client, local_service):
    """add_generation_prompt / continue_final_message / add_special_tokens render the prompt as
    vLLM's chat endpoint does (the decode renders the same body itself)."""
    tok = local_service.tokenizer
    msgs = [{"role": "user", "content": "Write a poem about the sea"}, {"role": "assistant", "content": "The sea"}]

    def prompt_tokens(**fields):
        r = client.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, **fields})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert prompt_tokens() == len(tok.encode_chat(msgs))
    assert prompt_tokens(add_generation_prompt=False) == len(tok.encode_chat(msgs, add_generation_prompt=False))
    cont = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert cont.endswith("The sea")
    assert prompt_tokens(add_generation_prompt=False, continue_final_message=True) == len(tok.encode(cont))


@pytest.mark.parametrize("fields,needle", [
    ({"continue_final_message": True}, "cannot both be true"),
    ({"add_generation_prompt": "perhaps"}, "add_generation_prompt"),  # ("no": false, as vLLM reads it)
    ({"chat_template": "{{ messages }}"}, "chat template sent with the request"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"truncate_prompt_tokens": 3}, "truncate_prompt_tokens=3 would cut"),
])
def test_bad_chat_rendering_fields_get_400(client, fields, needle):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi there"}], **fields})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                   "truncate_prompt_tokens": 1000})  # no cut: served
    assert ok.status_code == 200, ok.text


def test_values_are_read_as_vllm_reads_them(client):
    """A body vLLM 0.32 takes is taken (numbers as strings, 1 / "true" for flags, model "" = the served
    one, fields vLLM does not have ignored); what it refuses is refused, naming the field."""
    r = client.post("/v1/completions", json={"model": "", "prompt": "Hi", "max_tokens": "1", "temperature": "0",
                                             "stream": "true", "return_token_ids": 1, "logits_processors": ["x"]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert events[0]["choices"][0]["token_ids"] and events[0]["choices"][0]["prompt_token_ids"]
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "logprobs": 1, "top_logprobs": 2, "n": None})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    for body, field in (({"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
                        ({"tool_choice": "auto"}, "tool_choice"),
                        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"stream": []}, "stream"),
                        ({"structured_outputs": {}}, "structured_outputs"), ({"max_tokens": "ten"}, "max_tokens")):
        r = client.post("/v1/chat/completions", json={"messages": msgs, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


def test_prompt_larger_than_pool_is_refused(client, local_service):
    pool = local_service.worker.engine.pool
    n = pool.num_blocks * pool.block_size + 1  # fits the context (8192) but never the pool
    r = client.post("/v1/completions", json={"prompt": [1] * n})
    assert r.status_code == 400 and "shorter prompt" in r.json()["error"]["message"]


def prefills(service) -> float:
    return sum(s.value for m in service.worker.engine.metrics.prefills.collect() for s in m.samples
               if s.name.endswith("_total"))


def test_unreachable_decode_gives_502_then_fails_fast_until_it_is_back(local_service):
    """The first request finds the decode gone (502, its KV freed); from then on the decode is known
    down: readiness fails and requests get 503 at once, without a prefill, until /health answers."""
    url = f"http://127.0.0.1:{free_port()}"
    with TestClient(create_app(local_service, DecodeClient(url, timeout_s=5))) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4})
        assert r.status_code == 502
        assert url in r.json()["error"]["message"]
        before = prefills(local_service)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                 "stream": True})
        assert r.status_code == 503 and "is down" in r.json()["error"]["message"]
        assert r.headers["retry-after"] and url in r.json()["error"]["message"]
        assert prefills(local_service) == before  # refused before computing anything
        ready = c.get("/health")
        assert ready.status_code == 503 and url in ready.json()["reasons"][0]
        assert c.get("/livez").status_code == 200
        assert f'prefill_server:decode_up{{decode="{url}"}} 0.0' in c.get("/metrics").text
    assert local_service.worker.engine.pool.num_used == 0


def test_api_key(local_service):
    with TestClient(create_app(local_service, None, ApiKeys("s3cret"))) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        ok = c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200
        for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110)
            ok = c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": f"{scheme} s3cret"})
            assert ok.status_code == 200
        for wrong in ("Bearer s3cre", "Bearer s3cret ", "Basic s3cret", "s3cret"):
            assert c.post("/v1/completions", json={"prompt": "x"},
                          headers={"Authorization": wrong}).status_code == 401
        assert c.get("/metrics").status_code == 200  # open unless --protect-metrics
    with TestClient(create_app(local_service, None, ApiKeys("s3cret", protect_metrics=True))) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/livez").status_code == 200


def test_api_key_sources(tmp_path):
    """--api-key-file and PREFILL_SERVER_API_KEY keep the key out of ps."""
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert load_api_key(key_file=str(f), environ={}) == "from-file"
    assert load_api_key(environ={"PREFILL_SERVER_API_KEY": "from-env"}) == "from-env"
    assert load_api_key("flag", environ={"PREFILL_SERVER_API_KEY": "from-env"}) == "flag"
    assert load_api_key(environ={}) is None
    for bad in ({"key": "a", "key_file": str(f)}, {"key_file": str(tmp_path / "none")}, {"key": "a b"}):
        with pytest.raises(ValueError):
            load_api_key(**bad, environ={})

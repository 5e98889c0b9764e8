"""A server without a decode (transfer mode local) answers the first token alone, as vLLM 0.32 answers
a request that ends after one token: streamed as server-sent events shaped as vLLM's own stream
generators write them (``vllm_serving_reference.py``), logprobs, stop strings and stop token ids as
vLLM's output processing applies them, and what it cannot apply refused with the field named. The
engine runs the embedded SmolLM2 (``local_service``)."""
from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient

from prefill_server.engine.types import PrefillResult
from prefill_server.serving import first_draw, local_answer
from prefill_server.serving.http import create_app
from test_first_token import _keys
from test_stream_usage import KINDS, OPTIONS, REF_PROMPT, _same_shape, _t1_as_reference
from vllm_serving_reference import ask

PATH = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
PROMPT = {"completion": {"prompt": "The capital of France is"},
          "chat": {"messages": [{"role": "user", "content": "What is the capital of France?"}]}}


@pytest.fixture()
def client(local_service):
    with TestClient(create_app(local_service, None)) as c:
        yield c
    assert local_service.worker.engine.pool.num_used == 0  # (every answer released its KV)


def _ask(client, kind: str, **fields) -> tuple[int, object]:
    r = client.post(PATH[kind], json=PROMPT[kind] | {"temperature": 0} | fields)
    if r.status_code == 200 and fields.get("stream"):
        data = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        return 200, [d if d == "[DONE]" else json.loads(d) for d in data]
    return r.status_code, r.json()


@pytest.fixture(scope="module")
def vllm_one_token_streams():
    """vLLM's own events for one token that ends the answer, by (kind, stream_options index)."""
    cases = [(k, i) for k in KINDS for i in range(len(OPTIONS))]
    got = ask("streams", [{"endpoint": k, "body": {"stream_options": OPTIONS[i]} if OPTIONS[i] else {},
                           "prompt_tokens": REF_PROMPT, "texts": ["T1"], "finish_reason": "length"}
                          for k, i in cases])
    return {case: [e if e == "[DONE]" else json.loads(e) for e in events] for case, events in zip(cases, got)}


def _prompt_tokens(events: list) -> int:
    return next(e["usage"]["prompt_tokens"] for e in events if isinstance(e, dict) and e.get("usage"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("so", range(len(OPTIONS)))
def test_a_stream_is_vllms_stream_of_one_token(client, vllm_one_token_streams, kind, so):
    extra = {"stream_options": OPTIONS[so]} if OPTIONS[so] else {}
    status, events = _ask(client, kind, stream=True, max_tokens=8, **extra)
    assert status == 200, events
    theirs = vllm_one_token_streams[kind, so]
    n = _prompt_tokens(events) if OPTIONS[so] else REF_PROMPT
    last = events[-3 if OPTIONS[so] else -2]["choices"][0]
    text = last.get("text") or last.get("delta", {}).get("content")
    ours = [_same_shape(e, n) for e in _t1_as_reference(events)]
    # (vLLM names a fingerprint only where the server has one: this server has none)
    assert ours == [_same_shape({k: v for k, v in e.items() if k != "system_fingerprint"}, REF_PROMPT)
                    if isinstance(e, dict) else e for e in theirs]
    status, whole = _ask(client, kind, max_tokens=8)
    assert text == (whole["choices"][0].get("text") or whole["choices"][0].get("message", {}).get("content"))


@pytest.mark.parametrize("kind", KINDS)
def test_a_streamed_answer_has_one_id_of_the_whole_answers_form(client, kind):
    """vLLM's chunks carry the id its whole answer would (cmpl- / chatcmpl- and the request's id)."""
    status, events = _ask(client, kind, stream=True, stream_options={"include_usage": True})
    ids = {e["id"] for e in events if isinstance(e, dict)}
    status, whole = _ask(client, kind)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    assert len(ids) == 1 and ids.pop().startswith(prefix + "pf-") and whole["id"].startswith(prefix + "pf-")


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_answer_has_every_field_of_vllms(client, kind):
    theirs = ask("shapes")[kind]
    status, ours = _ask(client, kind)
    assert status == 200, ours
    assert _keys(theirs) - {".usage.prompt_tokens_details", ".usage.completion_tokens_details"} <= _keys(ours)
    u = ours["usage"]
    assert u["completion_tokens"] == 1 and u["total_tokens"] == u["prompt_tokens"] + 1
    assert ours["choices"][0]["finish_reason"] == "length"


def test_completion_logprobs_are_the_engines(client):
    status, a = _ask(client, "completion", logprobs=3)
    assert status == 200, a
    lp = a["choices"][0]["logprobs"]
    tok = a["choices"][0]["text"]
    assert lp["tokens"] == [tok] and lp["text_offset"] == [0]
    top = lp["top_logprobs"][0]
    assert len(top) == 3 and max(top.values()) == top[tok] == lp["token_logprobs"][0]  # (greedy: the best)
    assert sum(math.exp(v) for v in top.values()) < 1.0 + 1e-4
    status, ids = _ask(client, "completion", logprobs=0, return_tokens_as_token_ids=True)
    assert ids["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_chat_logprobs_are_the_engines(client):
    status, a = _ask(client, "chat", logprobs=True, top_logprobs=2)
    assert status == 200, a
    (entry,) = a["choices"][0]["logprobs"]["content"]
    assert entry["token"] == a["choices"][0]["message"]["content"]
    assert [t["token"] for t in entry["top_logprobs"]][0] == entry["token"] and len(entry["top_logprobs"]) == 2
    assert entry["bytes"] == list(entry["token"].encode())
    status, none = _ask(client, "chat", logprobs=False)
    assert none["choices"][0]["logprobs"] is None


def _greedy(client, kind: str) -> tuple[str, int]:
    """The greedy first token's text and id."""
    status, a = _ask(client, "completion", logprobs=0, return_tokens_as_token_ids=True)
    _, b = _ask(client, kind)
    text = b["choices"][0].get("text") or b["choices"][0]["message"]["content"]
    return text, int(a["choices"][0]["logprobs"]["tokens"][0].removeprefix("token_id:"))


def test_stop_strings_and_stop_token_ids_end_the_answer_as_in_vllm(client):
    text, t = _greedy(client, "completion")
    assert text == " Paris"
    _, a = _ask(client, "completion", stop=["zz", "ar", "P"])  # (the first in the list that matches)
    assert (a["choices"][0]["text"], a["choices"][0]["finish_reason"], a["choices"][0]["stop_reason"]) == \
        (" P", "stop", "ar")
    _, a = _ask(client, "completion", stop="ar", include_stop_str_in_output=True)
    assert a["choices"][0]["text"] == " Par"
    _, a = _ask(client, "completion", stop_token_ids=[str(t)])  # (vLLM's request class reads "7" as 7)
    choice = a["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("", "stop", t)
    _, a = _ask(client, "completion", stop=["London"])
    assert (a["choices"][0]["text"], a["choices"][0]["finish_reason"]) == (" Paris", "length")
    status, events = _ask(client, "chat", stop=["xyz"], stream=True)
    assert status == 200 and events[-1] == "[DONE]"


def test_min_tokens_keeps_the_stop_tokens_out_of_the_first_token(client, local_service):
    """As vLLM's min-tokens logits processor: while min_tokens is not reached, the stop tokens (the end
    tokens and stop_token_ids) are masked, so the greedy token is the best of the rest."""
    _, a = _ask(client, "completion", logprobs=2, return_tokens_as_token_ids=True)
    top = a["choices"][0]["logprobs"]["top_logprobs"][0]
    first, second = (int(k.removeprefix("token_id:")) for k in sorted(top, key=top.get, reverse=True))
    for stream in (False, True):
        _, b = _ask(client, "completion", min_tokens=1, max_tokens=4, stop_token_ids=[first], logprobs=1,
                    return_tokens_as_token_ids=True, stream=stream)
        choice = b[0]["choices"][0] if stream else b["choices"][0]
        assert choice["logprobs"]["tokens"] == [f"token_id:{second}"], b
        assert choice["finish_reason"] in (None, "length")
    _, b = _ask(client, "completion", min_tokens=0, stop_token_ids=[first])
    assert b["choices"][0]["finish_reason"] == "stop"  # (no min_tokens: drawn, and it ends the answer)
    # the end tokens are banned too (ignore_eos or not), as vLLM's all_stop_token_ids holds them
    eos = local_service.eos_token_ids
    assert first_draw.stop_bans(1, (first,), eos) == tuple(sorted({first, *eos}))
    assert first_draw.stop_bans(0, (first,), eos) == first_draw.stop_bans(None, (), eos) == ()
    # the other fields vLLM's sampler applies reach the engine too (tests/serving/test_first_draw.py
    # checks each against vLLM's sampler)
    ids = local_service.tokenizer.encode(PROMPT["completion"]["prompt"])
    for fields in ({"logit_bias": {str(second): 100}}, {"allowed_token_ids": [second, 7]}, {"bad_words": ["Paris"]},
                   {"repetition_penalty": 50.0, "prompt": ids + [first] + ids}):  # (" Paris" in the prompt)
        _, b = _ask(client, "completion", logprobs=0, return_tokens_as_token_ids=True, **fields)
        assert b["choices"][0]["logprobs"]["tokens"][0] != f"token_id:{first}", (fields, b)
    _, b = _ask(client, "completion", logprobs=0, return_tokens_as_token_ids=True, prompt=ids + [first] + ids)
    assert b["choices"][0]["logprobs"]["tokens"][0] == f"token_id:{first}"  # (the penalty made the difference)
    status, b = _ask(client, "completion", min_tokens=1, stop_token_ids=5)
    assert status == 400 and b["error"]["param"] == "stop_token_ids"


def test_the_end_token_ends_the_answer_unless_ignore_eos(local_service):
    from prefill_server.serving import first_token as ft

    tok, eos = local_service.tokenizer, local_service.eos_token_ids
    prompt = tok.encode("Hello")
    result = PrefillResult("r1", eos[0], len(prompt), 0, {})
    a = local_answer.LocalAnswer(ft.Plan("completion", {}, None, None, False), tok, eos, prompt, result, "m")
    assert (a.body()["choices"][0]["text"], a.finish_reason, a.stop_reason) == ("", "stop", None)
    a = local_answer.LocalAnswer(ft.Plan("chat", {"ignore_eos": True}, None, None, False), tok, eos, prompt,
                                 result, "m")
    assert a.finish_reason == "length" and a.body()["choices"][0]["message"]["content"] == ""  # (a special token)
    a = local_answer.LocalAnswer(ft.Plan("chat", {"ignore_eos": True, "skip_special_tokens": False}, None, None,
                                         False), tok, eos, prompt, result, "m")
    assert a.body()["choices"][0]["message"]["content"] == tok.decode([eos[0]], False)


@pytest.mark.parametrize("kind,fields,param", [
    ("completion", {"echo": True}, "echo"),
    ("completion", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("completion", {"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"logprobs": -1}, "logprobs"),
    ("completion", {"stop_token_ids": 5}, "stop_token_ids"),
    ("completion", {"stop_token_ids": "x"}, "stop_token_ids"),
    ("chat", {"stop_token_ids": [1, "x"]}, "stop_token_ids.1"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("chat", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
])
def test_what_the_answer_cannot_apply_is_refused_naming_it(client, kind, fields, param):
    status, a = _ask(client, kind, **fields)
    assert status == 400 and a["error"]["param"] == param, a
    assert "--decode-url" in a["error"]["message"] or param.split(".")[0] in ("logprobs", "top_logprobs",
                                                                            "stop_token_ids")


@pytest.mark.parametrize("kind,fields", [
    ("completion", {"presence_penalty": 0.5, "frequency_penalty": 0.5}),  # (output tokens only)
    ("completion", {"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "echo": False, "logit_bias": {}}),
    ("chat", {"response_format": {"type": "text"}, "tool_choice": "auto",
              "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", {"tool_choice": "none", "ignore_eos": True, "skip_special_tokens": False, "seed": 7, "top_k": 5}),
])
def test_what_leaves_the_first_token_as_it_is_is_accepted(client, kind, fields):
    status, a = _ask(client, kind, **fields)
    assert status == 200, a


def _ids_as_reference(events: list, n: int) -> list:
    """Our events with the prompt's ids and t1's id as the reference engine's (0..n-1, and 100)."""
    for e in events:
        for holder in [e, *e["choices"]] if isinstance(e, dict) else ():
            if holder.get("prompt_token_ids") is not None:
                holder["prompt_token_ids"] = list(range(n))
            if holder.get("token_ids") is not None:
                holder["token_ids"] = [100]
    return events


@pytest.mark.parametrize("kind", KINDS)
def test_return_token_ids_shows_the_prompts_and_the_tokens_ids_as_vllm_does(client, local_service, kind):
    status, whole = _ask(client, kind, max_tokens=8, return_token_ids=True)
    assert status == 200, whole
    ids = whole["prompt_token_ids"] if kind == "chat" else whole["choices"][0]["prompt_token_ids"]
    prompt = PROMPT[kind].get("prompt")
    if prompt is not None:
        assert ids == local_service.tokenizer.encode(prompt)
    assert len(ids) == whole["usage"]["prompt_tokens"]
    t = whole["choices"][0]["token_ids"]
    assert len(t) == 1 and local_service.tokenizer.decode(t) == (
        whole["choices"][0].get("text") or whole["choices"][0]["message"]["content"])
    status, events = _ask(client, kind, stream=True, max_tokens=8, return_token_ids=True)
    assert status == 200, events
    n = len(ids)
    theirs = ask("streams", [{"endpoint": kind, "body": {"return_token_ids": True}, "prompt_tokens": n,
                              "texts": ["T1"], "finish_reason": "length"}])[0]
    theirs = [e if e == "[DONE]" else json.loads(e) for e in theirs]
    ours = [_same_shape(e, n) for e in _ids_as_reference(_t1_as_reference(events), n)]
    assert ours == [_same_shape({k: v for k, v in e.items() if k != "system_fingerprint"}, n)
                    if isinstance(e, dict) else e for e in theirs]
    status, plain = _ask(client, kind, max_tokens=8, return_token_ids=False)
    assert plain["choices"][0]["token_ids"] is None  # (not asked: null, as before)

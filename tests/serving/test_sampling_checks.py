"""The gateway refuses a body the vLLM decode would refuse before computing its prompt.

Each body below is checked by ``openai_schema.parse`` and, where .venv-vllm exists, by vLLM 0.32's own
request classes (``vllm_serving_reference.py``): the two must agree on every body, so a prompt is prefilled
only for a request the decode will take, and no request the decode takes is refused here.
"""
from __future__ import annotations

import itertools

import pytest
from vllm_serving_reference import ask

from prefill_server.errors import InvalidRequest
from prefill_server.serving import first_draw
from prefill_server.serving import openai_schema as schema


PROMPT = {"model": "m", "prompt": "hello there"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}

# each field at, inside and just outside its range (and a few values of the wrong kind)
VALUES = {
    "temperature": [0, 0.0, 1e-6, 0.7, 2, 2.0, 2.0001, -1e-9, -1, 3],
    "top_p": [1, 1.0, 0.5, 1e-9, 0, 0.0, 1.0001, -0.1],
    "top_k": [-2, -1, 0, 1, 50, 1.5],
    "min_p": [0, 0.0, 0.5, 1, 1.0, 1.01, -0.01],
    "presence_penalty": [-2, -2.0, -2.0001, 0, 1.5, 2, 2.0001, 5],
    "frequency_penalty": [-2, -2.5, 0, 2, 2.5],
    "repetition_penalty": [1, 1.3, 1e-9, 0, 0.0, -1],
    "min_tokens": [-1, 0, 3],
    "stop": ["", "x", [], [""], ["x", ""], ["x", "y"]],
    "prompt_logprobs": [-2, -1, 0, 1],
    # token ids (the vocabulary's bounds are checked against the model's size: test_first_draw.py)
    "logit_bias": [{"3": 1}, {"3": -1.5}, {"3": 1e9}, {"3": "1.5"}, {"3": True}, {"3": None}, {"x": 1}, {" 3": 1},
                   {"3.0": 1}, {}, [], None, "3"],
    "stop_token_ids": [[1], [], [1.5], [True], ["1"], "1", 1, None],
    "allowed_token_ids": [[1], [1, 1], [1.5], [True], ["1"], "1", None],  # ([]: refused by vLLM's verify)
    # (each word's tokens: test_first_draw.py; null, which vLLM's request class refuses, is taken as absent
    # here: SGLang decodes' clients may send it, and a vLLM decode still answers it with its own 400)
    "bad_words": [["x"], [], [1], "x", [None]],
    "cache_salt": ["s", "x" * 128, "x" * 129, "", "a/b", "a@b", "a\\b", "a\x00b", None, 5, ["s"]],
}
COMPLETION_ONLY = {"logprobs": [-2, -1, 0, 1, 5]}
CHAT_ONLY = {"top_logprobs": [-2, -1, 0, 1, 5], "tools": [[], [{"type": "function",
                                                                  "function": {"name": "f", "parameters": {}}}]]}
PAIRS = [  # checks across fields
    {"stream_options": {"include_usage": True}}, {"stream_options": {"include_usage": True}, "stream": True},
    {"stream_options": {}}, {"min_tokens": 5, "max_tokens": 4}, {"min_tokens": 4, "max_tokens": 4},
    {"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": -1, "stream": True},
    {"prompt_logprobs": 0, "stream": True},
]
CHAT_PAIRS = [{"top_logprobs": 2, "logprobs": True}, {"top_logprobs": 2, "logprobs": False},
              {"top_logprobs": -1}, {"top_logprobs": 0}, {"min_tokens": 5, "max_completion_tokens": 4},
              {"min_tokens": 5, "max_completion_tokens": 8, "max_tokens": 2}]


def _cases() -> list[dict]:
    cases = []
    for endpoint, base, only, pairs in (("completion", PROMPT, COMPLETION_ONLY, PAIRS),
                                        ("chat", CHAT, CHAT_ONLY, PAIRS + CHAT_PAIRS)):
        for field, values in itertools.chain(VALUES.items(), only.items()):
            cases += [{"endpoint": endpoint, "body": {**base, field: v}} for v in values]
        cases += [{"endpoint": endpoint, "body": {**base, **extra}} for extra in pairs]
    return cases


def _ours(case: dict) -> tuple[bool, str]:
    cls = schema.ChatBody if case["endpoint"] == "chat" else schema.CompletionBody
    try:
        first_draw.openai_sampling(schema.parse(cls, case["body"]), case["body"], (2,), 10**6)
        return True, ""
    except InvalidRequest as e:
        return False, e.field or ""


@pytest.mark.parametrize("extra, field", [
    ({"presence_penalty": 5}, "presence_penalty"), ({"temperature": 3}, "temperature"),
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop": ["a", ""]}, "stop"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"), ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"logprobs": -3}, "logprobs"),
])
def test_a_body_the_decode_refuses_is_refused_naming_its_field(extra, field):
    ok, where = _ours({"endpoint": "completion", "body": {**PROMPT, **extra}})
    assert (ok, where) == (False, field)


@pytest.mark.parametrize("extra, field", [({"tools": []}, "tools"), ({"top_logprobs": 3}, "top_logprobs"),
                                          ({"min_tokens": 5, "max_completion_tokens": 4}, "min_tokens")])
def test_a_chat_the_decode_refuses_is_refused_naming_its_field(extra, field):
    ok, where = _ours({"endpoint": "chat", "body": {**CHAT, **extra}})
    assert (ok, where) == (False, field)


def test_the_messages_say_what_to_change():
    with pytest.raises(InvalidRequest, match=r"set \"stream\": true or drop stream_options"):
        schema.parse(schema.CompletionBody, {**PROMPT, "stream_options": {"include_usage": True}})
    with pytest.raises(InvalidRequest, match=r"top_logprobs needs \"logprobs\": true"):
        schema.parse(schema.ChatBody, {**CHAT, "top_logprobs": 2})


def test_our_checks_agree_with_vllms_own_on_every_body():
    cases = _cases()
    theirs = ask("bodies", cases)
    assert len(theirs) == len(cases)
    disagree = [(c["endpoint"], {k: v for k, v in c["body"].items() if k not in CHAT and k not in PROMPT},
                 _ours(c), t) for c, t in zip(cases, theirs) if _ours(c)[0] != t["ok"]]
    assert not disagree, disagree
    assert sum(not t["ok"] for t in theirs) >= 40  # the corpus does probe the refusals

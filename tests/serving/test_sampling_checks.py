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
    # read as vLLM's pydantic reads them (lax): numbers as strings, true as 1, null where its field allows it
    "max_tokens": [1, 0, -1, True, "5", 5.0, 5.5, "x", None, 1e30],
    "n": [1, 0, True, "1", None, 1.0],  # (2 and more: refused here on purpose, below)
    "seed": [5, -1, True, "5", 2**63, -2**63, None, 1.5],
    "stream": [True, False, None, 0, 1, "true", "yes", "off", "x", [], {}],
    "user": ["u", None, 5, ""],
    "priority": [0, None, "x", True, 2**63, -2**63],
    "length_penalty": [1.0, None, "x", "2"],
    "structured_outputs": [{"json": {"type": "object"}}, {}, None, 5, "x", [], True],
    "truncate_prompt_tokens": [None, -1, -2, 5, True, "5", 2**63],
    "request_id": ["r", "", None, 5],
    "vllm_xargs": [{"a": 1, "b": ["x", 2.5]}, {}, None, 5, "x", {"a": {"b": 1}}, {"a": None}],
    "response_format": [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                        {"type": "json_schema", "json_schema": {"schema": {}}}, {"type": "xml"}, {}, 5, "x", None,
                        {"type": "structural_tag"}, {"type": "text", "x": 1}],  # (a structural tag's own rules: the
    # decode's to check, and refused where the first token is drawn here)
}
# the flags the gateway reads itself (where the first token is the answer)
for _flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
              "use_beam_search", "return_token_ids", "return_tokens_as_token_ids", "echo", "add_special_tokens"):
    VALUES[_flag] = [True, False, 0, 1, "yes", "no", None, "x", [], 2]
for _field, _more in (("temperature", ["0.7", True, "nan", "inf", None, "x"]), ("top_k", [True, "5", None]),
                      ("top_p", ["0.5", True, None]), ("min_tokens", [None, True, "3"]),
                      ("prompt_logprobs", [True, "1", None]), ("stop", [5, [5], None]),
                      ("presence_penalty", ["1", True, None]), ("repetition_penalty", ["1.1", True, None])):
    VALUES[_field] = VALUES[_field] + _more
COMPLETION_ONLY = {"logprobs": [-2, -1, 0, 1, 5, True, "2", None, 2.0]}
CHAT_ONLY = {"top_logprobs": [-2, -1, 0, 1, 5, None],
             "tools": [[], [{"type": "function", "function": {"name": "f", "parameters": {}}}], [{"a": 1}],
                       [{"function": {"name": 5}}], [{"type": "x", "function": {"name": "f"}}], None, 5],
             "logprobs": [True, False, None, 0, 1, "yes", [], 5],
             "max_completion_tokens": [None, 0, 1, True, "4", 4.5],
             "add_generation_prompt": [True, False, 0, None, "x"], "continue_final_message": [False, 0, None, "x"],
             "tool_choice": [None, "none", "auto", "required", "x", 5, {"function": {"name": "f"}}],
             "parallel_tool_calls": [True, None, 0, "x", []], "reasoning_effort": [None, "low", "max", "x", 5],
             "mm_processor_kwargs": [None, {}, 5, "x"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
PAIRS = [  # checks across fields
    {"stream_options": {"include_usage": True}}, {"stream_options": {"include_usage": True}, "stream": True},
    {"stream_options": {}}, {"min_tokens": 5, "max_tokens": 4}, {"min_tokens": 4, "max_tokens": 4},
    {"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": -1, "stream": True},
    {"prompt_logprobs": 0, "stream": True},
]
CHAT_PAIRS = [{"top_logprobs": 2, "logprobs": True}, {"top_logprobs": 2, "logprobs": False},
              {"top_logprobs": 2, "logprobs": "true"}, {"top_logprobs": 2, "logprobs": 1},
              {"top_logprobs": None, "logprobs": True}, {"top_logprobs": "2", "logprobs": True},
              {"tools": TOOLS, "tool_choice": "required"}, {"tools": TOOLS, "tool_choice": "x"},
              {"tools": TOOLS, "tool_choice": {"function": {"name": "f"}}},
              {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
              {"tools": TOOLS, "tool_choice": {"function": {}}}, {"tools": TOOLS, "tool_choice": {"function": "f"}},
              {"tools": TOOLS, "tool_choice": {"type": "x", "function": {"name": "f"}}},
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
        body = dict(case["body"])
        first_draw.openai_sampling(schema.parse(cls, body), body, (2,), 10**6).validate()
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


def test_several_choices_are_refused_saying_what_to_send():
    for base, cls in ((PROMPT, schema.CompletionBody), (CHAT, schema.ChatBody)):
        with pytest.raises(InvalidRequest, match="send n separate requests") as e:
            schema.parse(cls, {**base, "n": "2"})
        assert e.value.field == "n"


def test_the_body_holds_the_values_as_read():
    """A lax value is read as vLLM reads it and written back, so what reads the body later (the first
    token's answer, the decode's request) sees the same value; messages stay as sent."""
    body = {**CHAT, "temperature": "0.5", "stream": "yes", "ignore_eos": 1, "max_tokens": 4.0, "top_logprobs": None,
            "logprobs": "true", "stop_token_ids": ["7"], "extra": "kept"}
    parsed = schema.parse(schema.ChatBody, body)
    assert body == {**CHAT, "temperature": 0.5, "stream": True, "ignore_eos": True, "max_tokens": 4,
                    "top_logprobs": 0, "logprobs": True, "stop_token_ids": [7], "extra": "kept"}
    assert parsed.temperature == 0.5 and body["messages"] is CHAT["messages"] or body["messages"] == CHAT["messages"]
    for v in (1, "true", "on"):
        body = {**PROMPT, "return_token_ids": v, "echo": 0}
        schema.parse(schema.CompletionBody, body)
        assert body["return_token_ids"] is True and body["echo"] is False


def test_our_checks_agree_with_vllms_own_on_every_body():
    cases = _cases()
    theirs = ask("bodies", cases)
    assert len(theirs) == len(cases)
    disagree = [(c["endpoint"], {k: v for k, v in c["body"].items() if k not in CHAT and k not in PROMPT},
                 _ours(c), t) for c, t in zip(cases, theirs) if _ours(c)[0] != t["ok"]]
    assert not disagree, disagree
    assert sum(not t["ok"] for t in theirs) >= 40  # the corpus does probe the refusals

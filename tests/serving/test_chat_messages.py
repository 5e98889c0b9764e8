"""A chat body's messages reach the template here as vLLM 0.32's serving hands them to its template
(``prefill_server/serving/chat_messages.py``): the same fields kept, tool-call arguments parsed,
reasoning under both names, Claude Code's attribution line dropped, malformed tool calls refused.
Checked against vLLM's own code run in .venv-vllm (``vllm_serving_reference.py messages``)."""
import pytest
from vllm_serving_reference import ask

from prefill_server.errors import InvalidRequest
from prefill_server.serving import openai_schema as schema


def call(args="{}", **extra):
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}, **extra}


A = "assistant"
CONVERSATIONS = [
    [{"role": "user", "content": "hi", "foo": 1, "tool_call_id": "c", "tool_calls": []}],
    [{"role": "user", "content": "hi", "name": "n", "task": "t"}, {"role": "user", "content": "x", "task": 5}],
    [{"role": "user", "content": "x", "name": 5}],
    [{"role": "user", "content": "x", "name": None}],
    [{"role": A, "content": None, "tool_calls": [call('{"city": "Paris"}')]}],
    [{"role": A, "content": "x", "tool_calls": [call("not json"), call("[1]"), call(""), call("42")]}],
    [{"role": A, "content": "x", "tool_calls": []}, {"role": A, "content": "y", "tool_calls": None}],
    [{"role": A, "content": "x", "tool_calls": [call("{}", index=0) | {"function": {"name": "f", "arguments": "{}",
                                                                                   "strict": True}}]}],
    [{"role": A, "content": "x", "reasoning_content": "r"}],
    [{"role": A, "content": "x", "reasoning": "a", "reasoning_content": "b"}],
    [{"role": A, "content": "x", "reasoning": None, "reasoning_content": "b"}],
    [{"role": "user", "content": "x", "reasoning": "r", "reasoning_content": "r"}],
    [{"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "tool", "content": "7"}],
    [{"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "tool_call_id": "c"}],
    [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}],
    [{"role": "developer", "content": "d", "tools": [{"type": "function", "function": {"name": "f"}}]}],
    [{"role": "system", "content": "x-anthropic-billing-header: cc_version=1; cch=9f\nYou are Claude Code."}],
    [{"role": "system", "content": "x-anthropic-billing-header: cch=1"}, {"role": "user", "content": "u"}],
    [{"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: a"},
                                    {"type": "text", "text": "keep"}]}],
    [{"role": "user", "content": "x-anthropic-billing-header: stays in user text"}],
    [{"role": A, "content": "x", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
    [{"role": A, "content": "x", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]}],
    [{"role": A, "content": "x", "tool_calls": [call({"a": 1})]}],
    [{"role": A, "content": "x", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f"}}]}],
    [{"role": A, "content": "x", "tool_calls": [{"id": "a", "type": "function", "function": {"arguments": "{}"}}]}],
    [{"role": A, "content": "x", "tool_calls": [{"id": "a", "type": "custom", "custom": {"name": "f", "input": ""}}]}],
    [{"role": A, "content": "x", "tool_calls": [{"id": 5, "type": "function",
                                                  "function": {"name": "f", "arguments": "{}"}}]}],
    [{"role": A, "content": "x", "tool_calls": ["f"]}],
    [{"role": A, "content": "x", "tool_calls": {"id": "a"}}],
    [{"role": "tool", "content": "x", "tool_call_id": 5}],
    [{"role": "wizard", "content": "x", "name": "w", "tool_call_id": "c", "tools": [], "reasoning": "r"}],
    [{"role": "function", "content": "42", "name": "f"}, {"role": "ipython", "content": [{"type": "text", "text": "a"}]}],
    [{"role": "USER", "content": "x"}, {"role": "", "content": "y"}, {"role": "user ", "content": "z"}],
    [{"role": "wizard", "content": None}],
    [{"role": "wizard"}],
]


def ours(conv):
    try:
        return schema.chat_messages(schema.parse(schema.ChatBody, {"messages": conv}))
    except InvalidRequest as e:
        return {"error": str(e)}


def test_messages_reach_the_template_as_vllm_hands_them_over():
    mine = [ours(c) for c in CONVERSATIONS]
    assert mine[4] == [{"role": A, "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}}]}]
    assert mine[8] == [{"role": A, "content": "x", "reasoning": "r", "reasoning_content": "r"}]
    assert mine[16] == [{"role": "system", "content": "You are Claude Code."}]
    assert "error" in mine[29] and "error" in mine[20] and "error" in mine[2]
    for conv, mine_one, theirs in zip(CONVERSATIONS, mine, ask("messages", CONVERSATIONS)):
        if "error" in theirs:
            assert isinstance(mine_one, dict) and "error" in mine_one, (conv, theirs["error"], mine_one)
        else:
            assert mine_one == theirs, conv


def test_a_refused_tool_call_names_the_field_and_the_form():
    with pytest.raises(InvalidRequest) as e:
        schema.chat_messages(schema.parse(schema.ChatBody, {"messages": [
            {"role": "user", "content": "u"}, {"role": A, "content": "x", "tool_calls": [call(), {"id": "b"}]}]}))
    assert e.value.field == "messages.1.tool_calls.1" and '"type": "function"' in str(e.value)

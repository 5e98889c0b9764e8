"""Chat messages as vLLM 0.32 hands them to a chat template, so the prompt prefilled here is the
one the decode renders (the KV must be that prompt's).

vLLM keeps a message's role and content and only these fields: an assistant's ``tool_calls`` and
its ``reasoning`` (or, without it, its ``reasoning_content``), given to the template under both
names; a tool's ``tool_call_id``; a ``name`` or ``task`` that is a string; a developer's ``tools``
(None where absent). Everything else a client sends never reaches the template. It drops Claude
Code's attribution line from system text, refuses tool calls that are not OpenAI function calls
(an ``id``, ``"type": "function"``, a ``function`` with a string ``name`` and string ``arguments``)
and gives templates their ``arguments`` as objects (the JSON parsed; malformed or not an object:
``{}``). Checked against vLLM's own request class, ``_parse_chat_message_content`` and
``_postprocess_messages`` (``tests/serving/test_chat_messages.py``).
"""
from __future__ import annotations

import json
from typing import Any

from prefill_server.errors import InvalidRequest

# the first line of Claude Code's system text; its value changes every request (vLLM drops it)
_BILLING_HEADER = "x-anthropic-billing-header"


def system_texts(texts: list[str]) -> list[str]:
    """A system message's text parts without Claude Code's attribution line (a part that was only
    that line goes)."""
    out = []
    for text in texts:
        if text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out


def template_message(i: int, message: dict[str, Any], content: str) -> dict[str, Any]:
    """Message ``i`` (a client's dict, its text parts already joined into ``content``) as the
    template sees it."""
    role = message["role"]
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            calls = _tool_calls(i, message["tool_calls"])
            if calls:  # (an empty list goes: the template then takes the plain assistant path)
                out["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise InvalidRequest(f"messages.{i}.tool_call_id must be a string", field=f"messages.{i}.tool_call_id")
        out["tool_call_id"] = message["tool_call_id"]
    if "name" in message and not isinstance(message["name"], str):
        raise InvalidRequest(f"messages.{i}.name must be a string", field=f"messages.{i}.name")
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant's tool calls with each function's arguments as an object. vLLM fails on what is
    not a list of function calls (a 400 here)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"messages.{i}.tool_calls must be a list of tool calls", field=f"messages.{i}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        where = f"messages.{i}.tool_calls.{j}"
        if not isinstance(call, dict):
            raise InvalidRequest(f"{where} must be an object", field=where)
        function = call.get("function")
        if (call.get("type") != "function" or not isinstance(call.get("id"), str) or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str)):
            raise InvalidRequest(f"{where} must be a function call: {{\"id\": str, \"type\": \"function\", "
                                 "\"function\": {\"name\": str, \"arguments\": str}}", field=where)
        out.append({**call, "function": {**function, "arguments": _arguments(function["arguments"])}})
    return out


def _arguments(args: str) -> dict:
    try:
        parsed = json.loads(args) if args else {}
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}

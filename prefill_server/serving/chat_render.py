"""How a chat body is rendered here, as vLLM 0.32's chat endpoint renders it at the decode (which
gets the same body and renders it itself, so both must make the same tokens).

vLLM's rules (``ChatCompletionRequest.build_chat_params`` and the HF renderer): ``chat_template_kwargs``
go to the template, overridden by the request's own ``add_generation_prompt`` (default true),
``continue_final_message`` (default false), ``documents`` and ``reasoning_effort`` where set (the
latter also sets ``enable_thinking`` unless the kwargs do); ``add_special_tokens`` (default false)
adds the tokenizer's special tokens around the rendered text; a template sent in the request is
refused unless the decode trusts request templates, and this server always renders the model's own.
"""
from __future__ import annotations

from typing import Any

from prefill_server.errors import InvalidRequest
from prefill_server.serving.decode_tokenizer import chat_fields


def template_kwargs(request: dict) -> dict[str, Any]:
    """The keyword arguments of ``token_parity.local_chat_ids`` for a chat body that passed
    ``openai_schema.ChatBody`` (so ``chat_template_kwargs`` is an object or absent)."""
    fields = chat_fields(request)
    kwargs = fields.get("chat_template_kwargs") or {}
    if request.get("chat_template") is not None or kwargs.get("chat_template") is not None:
        raise InvalidRequest("a chat template sent with the request is not taken: the prefill server renders "
                             "the model's own template (as a vLLM decode without --trust-request-chat-template "
                             "does); leave chat_template out", field="chat_template")
    if "tokenize" in kwargs:
        raise InvalidRequest("chat_template_kwargs may not set 'tokenize'", field="chat_template_kwargs")
    out = dict(kwargs)
    out["add_generation_prompt"] = request.get("add_generation_prompt", True)
    out["continue_final_message"] = request.get("continue_final_message", False)
    out["add_special_tokens"] = request.get("add_special_tokens", False)
    if fields.get("tools"):
        out["tools"] = fields["tools"]
    return out

"""The answer of a server without a decode (``--transfer-mode local``, or a prefill instance asked
for its first token without a router's ``kv_transfer_params``): that first token alone, drawn here,
as vLLM 0.32 answers a request that ends after one token.

The engine draws the token with the sampling fields vLLM's sampler applies to a first token
(``first_draw.openai_sampling``: temperature, top_p, top_k, min_p, seed, the repetition penalty,
logit_bias, allowed_token_ids, bad_words, min_tokens) and gives its raw logprobs; the answer
applies what vLLM's output processing applies to one token: the end-of-sequence token (unless
``ignore_eos``), ``stop_token_ids``, ``stop`` strings (``include_stop_str_in_output``) and
``skip_special_tokens``; ``stream`` gets server-sent events. A field that would have changed which
token is drawn (logits processors, structured output, beam search) or added to the answer
(echo, prompt logprobs) is refused, naming it, rather than answered as if it were absent.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from prefill_server.engine.worker import MAX_LOGPROBS, PrefillResult
from prefill_server.errors import InvalidRequest
from prefill_server.serving import first_draw
from prefill_server.serving import first_token as ft
from prefill_server.serving.openai_schema import usage_asked
from prefill_server.serving.relay import sse

# what a one-token answer would have added to (field -> the value that means "off")
_ADDS = {"echo": False, "prompt_logprobs": None}


def plan(kind: str, body: dict, who: str) -> ft.Plan:
    """What the answer will show, for a validated body of ``kind`` ("completion" | "chat"); a
    field it cannot honour is refused. ``who``: what this server is, for the refusal's message."""
    g = body.get
    first_draw.check(body, who)
    for key, off in _ADDS.items():
        if g(key) is not None and g(key) != off:
            raise InvalidRequest(f"'{key}' adds to the answer, which {who} gives as the first token alone: drop it "
                                 f"(or leave it at {json.dumps(off)})", field=key)
    if kind == "chat":
        k, field = ((g("top_logprobs") or 0), "top_logprobs") if g("logprobs") is True else (None, "logprobs")
    else:
        k, field = g("logprobs"), "logprobs"
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise InvalidRequest(f"'{field}' is {k}: at most {MAX_LOGPROBS} logprobs per token are returned (vLLM's "
                             "default --max-logprobs)", field=field)
    return ft.Plan(kind, body, None, k, g("return_tokens_as_token_ids") is True)


class LocalAnswer:
    """The first token, drawn for ``plan`` after ``prompt_ids``, as the client's answer."""

    def __init__(self, p: ft.Plan, tokenizer, eos_ids, prompt_ids: list[int], result: PrefillResult,
                 model: str):
        b, t = p.body, result.first_token_id
        self.request_id, self.model = result.request_id, model
        text = tokenizer.continuation_text(prompt_ids, t, b.get("skip_special_tokens") is not False) or ""
        keep_stop = b.get("include_stop_str_in_output") is True
        self.finish_reason, self.stop_reason = "length", None
        if t in eos_ids and b.get("ignore_eos") is not True:  # (vLLM: the stop token's text is not shown)
            self.finish_reason, text = "stop", text if keep_stop else ""
        elif t in {int(i) for i in b.get("stop_token_ids") or ()}:  # (validated: "7" and 7.0 are 7, as in vLLM)
            self.finish_reason, self.stop_reason, text = "stop", t, text if keep_stop else ""
        else:
            stops = [b["stop"]] if isinstance(b.get("stop"), str) else b.get("stop") or []
            for s in stops:  # (in the order given, as vLLM's check_stop_strings)
                if (i := text.find(s)) >= 0:
                    self.finish_reason, self.stop_reason = "stop", s
                    text = text[:i + len(s)] if keep_stop else text[:i]
                    break
        self.first = ft.FirstToken(p, t, text, result.first_logprobs, len(prompt_ids), tokenizer,
                                   cached_tokens=result.num_cached_tokens,
                                   shown_prompt_ids=tuple(prompt_ids) if b.get("return_token_ids") is True else None)

    def body(self) -> dict:
        return self.first.alone(self.request_id, self.model, self.finish_reason, self.stop_reason)

    async def events(self, on_end: Callable[[], None]) -> AsyncIterator[bytes]:
        """The streamed answer: (chat: the role) and the token with its finish, the usage where
        ``stream_options`` asks for it, then ``[DONE]``."""
        try:
            state = self.first.stream_start(self.request_id)
            yield state.first(self.model, self.finish_reason, self.stop_reason)
            if (usage_asked(self.first.plan.body.get("stream_options")) or (False, False))[0]:
                yield state.usage()
            yield sse("[DONE]")
        finally:
            on_end()

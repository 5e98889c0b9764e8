"""The first token from our prefill (``--first-token prefill``, the default for greedy requests).

vLLM's scheduler always computes a prompt's last token on the decode, in a 1-token step, where vLLM
serving alone computes it inside the prompt's step. In bf16 the two steps round differently, and at
an exact tie between the top two tokens they pick different first tokens. So for a greedy request
the gateway takes the first token t1 from our prefill (the same bits as vLLM alone's prefill), sends
it to the client as soon as the decode has accepted the rest, and asks the decode (stock
``/v1/completions``, prompt token ids) for prompt + [t1] with one token fewer. The decode loads our
KV for the prompt (``remote_num_tokens`` = the prompt's length) and computes t1's position in a
1-token step, exactly as vLLM alone's first decode step does. It allocates KV blocks for all of
prompt + [t1], and a stock NixlConnector decode asserts that the prefill offers as many blocks (its
engine dies otherwise), so the prefill leases room for t1's position (``room_tokens``) and the
params offer exactly the blocks of the prompt the decode is sent (``params_for_prompt``). Chat requests go the same way; the
decode's completion is turned back into a chat completion here.

A request takes this path only where that changes nothing the client can see: temperature 0, one
choice, no penalties, stop strings, logit bias, structured output, tools, echo or extra chat
options (``plan`` lists what is allowed), and a t1 that does not end the request and is whole text.
Every other request goes the ordinary way (the decode samples t1 itself).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from prefill_server.engine.worker import MAX_LOGPROBS, SAMPLING_EPS
from prefill_server.serving.openai_schema import usage_asked
from prefill_server.serving.relay import sse

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
           "stream_options", "n", "user", "ignore_eos", "skip_special_tokens",
           "spaces_between_special_tokens", "frequency_penalty", "presence_penalty",
           "repetition_penalty", "stop", "stop_token_ids", "return_tokens_as_token_ids", "logprobs", "cache_salt"}
_ALLOWED = {"completion": _COMMON | {"prompt", "echo", "best_of"},
            "chat": _COMMON | {"messages", "top_logprobs", "max_completion_tokens"}}
# A completion request without max_tokens (or with null) asks for this many (vLLM's CompletionRequest
# default; a chat's is what the context leaves): the decode's request for the rest is a completion, so
# it is always given its limit.
COMPLETION_MAX_TOKENS = 16
# Fields the decode must see as given (the rest of the decode's body is built here).
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "user", "ignore_eos", "skip_special_tokens",
           "spaces_between_special_tokens", "stop_token_ids", "cache_salt")


# the fields vLLM 0.32's answers carry as null when unused (a client may index them): the answer
# merged here has them too (the requests that set them go the ordinary way, ``_ALLOWED``)
_NULLS = ("service_tier", "kv_transfer_params", "ec_transfer_params", "metrics")
_CHAT_NULLS = ("prompt_logprobs", "prompt_token_ids", "prompt_text")
_COMPLETION_CHOICE_NULLS = ("token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts")
_CHAT_CHOICE_NULLS = ("token_ids", "routed_experts")
_MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")
# and in its streamed chunks: the chat role chunk's, and every completion choice's
_STREAM_CHAT_FIRST_NULLS = ("prompt_token_ids", "prompt_text")
_STREAM_COMPLETION_CHOICE_NULLS = ("prompt_token_ids", "token_ids")


@dataclass(frozen=True)
class Plan:
    """A request that may take its first token from the prefill (decided before the prefill)."""

    kind: str  # "completion" | "chat"
    body: dict  # the client's JSON body
    max_tokens: int | None  # the whole answer's limit (None, a chat's default: what the context leaves)
    num_logprobs: int | None  # logprobs asked for: None = none, k = top k (+ the sampled token)
    as_token_ids: bool  # the client asked for "token_id:N" strings

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def plan(kind: str, body: dict) -> Plan | None:
    """The plan for a validated request body, or None when it must go the ordinary way."""
    if not set(body) <= _ALLOWED[kind]:
        return None
    g = body.get
    temperature = g("temperature")
    if not isinstance(temperature, (int, float)) or temperature >= SAMPLING_EPS:
        return None  # not greedy (an absent temperature takes the model's default, not 0)
    if g("n", 1) != 1 or g("best_of") not in (None, 1) or g("echo"):
        return None
    if g("frequency_penalty") not in (None, 0) or g("presence_penalty") not in (None, 0) \
            or g("repetition_penalty") not in (None, 1):
        return None  # penalties would have changed t1 or count it differently as prompt
    if g("stop") not in (None, "", []):
        return None  # a stop string could end in t1 or span it and the next token
    so = g("stream_options")
    if so is not None and not (isinstance(so, dict) and set(so) <= {"include_usage", "continuous_usage_stats"}):
        return None
    if not isinstance(g("stop_token_ids", []), (list, type(None))):
        return None
    if kind == "chat":
        max_tokens = g("max_completion_tokens") if g("max_completion_tokens") is not None else g("max_tokens")
    else:  # (absent or null: vLLM's completion default)
        max_tokens = COMPLETION_MAX_TOKENS if g("max_tokens") is None else g("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 2):
        return None
    if kind == "chat":
        num_logprobs = None
        if g("logprobs") is True:
            num_logprobs = g("top_logprobs") or 0
        elif g("logprobs") not in (None, False) or g("top_logprobs") is not None:
            return None
    else:
        num_logprobs = g("logprobs")
    if num_logprobs is not None and (not isinstance(num_logprobs, int) or isinstance(num_logprobs, bool)
                                     or not 0 <= num_logprobs <= MAX_LOGPROBS):
        return None
    as_ids = g("return_tokens_as_token_ids")
    if as_ids not in (None, True, False):
        return None
    return Plan(kind, body, max_tokens, num_logprobs, bool(as_ids))


@dataclass(frozen=True)
class FirstToken:
    """t1 as the prefill sampled it, and how the rest of the answer is put together."""

    plan: Plan
    token_id: int
    text: str
    logprobs: tuple[tuple[int, float], ...] | None  # (sampled, lp), then the top k
    num_prompt_tokens: int
    tokenizer: Any
    cached_tokens: int | None = None  # the prefill's prefix-cache hit, for usage (None: no prefix cache)
    # ``return_token_ids`` in an answer t1 is all of: the prompt's ids, shown (with [t1]) where vLLM shows them
    shown_prompt_ids: tuple[int, ...] | None = None
    max_model_len: int = 0  # the decode's context (a chat without a limit may fill it)

    # ---- the decode's request ----
    def decode_body(self, prompt_ids: list[int], served_name: str, kv_transfer_params: dict) -> dict:
        b, p = self.plan.body, self.plan
        out = {k: b[k] for k in _PASSED if k in b}
        out |= {"model": b.get("model") or served_name, "prompt": [*prompt_ids, self.token_id],
                "stream": p.stream, "kv_transfer_params": kv_transfer_params}
        # the rest of the answer: one token fewer than the whole answer's limit (a chat's default
        # is what the context leaves after the prompt; vLLM 0.32's completion takes null as 16)
        limit = self.max_model_len - len(prompt_ids) if p.max_tokens is None else p.max_tokens
        out["max_tokens"] = limit - 1
        if "stream_options" in b:
            out["stream_options"] = b["stream_options"]
        if p.num_logprobs is not None:  # as ids: strings are made here, for both kinds
            out["logprobs"] = p.num_logprobs
            out["return_tokens_as_token_ids"] = True
        return out

    # ---- pieces ----
    def _tok(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.plan.as_token_ids else self.tokenizer.token_string(token_id)

    def _entries(self, token_logprob: dict) -> list[tuple[int, float]]:
        return [(_token_id(k), v) for k, v in token_logprob.items()]

    def _first_entries(self) -> list[tuple[int, float]]:
        """(sampled, lp) then top k, duplicates merged in place, as vLLM's dict keeps them."""
        merged: dict[int, float] = {}
        for tid, lp in self.logprobs or ():
            merged[tid] = lp
        return list(merged.items())

    def _completion_lp(self, tokens: list[int], lps: list[float], tops: list[list[tuple[int, float]]],
                       offset: int) -> tuple[dict, int]:
        """Completion logprobs for these tokens, text offsets from ``offset``; returns the next one."""
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for tid, lp, top in zip(tokens, lps, tops):
            s = self._tok(tid)
            out["text_offset"].append(offset)
            out["tokens"].append(s)
            out["token_logprobs"].append(max(lp, -9999.0))
            out["top_logprobs"].append({self._tok(t): max(v, -9999.0) for t, v in top})
            offset += len(s)
        return out, offset

    def _chat_lp(self, tokens: list[int], lps: list[float], tops: list[list[tuple[int, float]]]) -> dict:
        k = self.plan.num_logprobs or 0
        content = []
        for tid, lp, top in zip(tokens, lps, tops):
            s = self._tok(tid)
            content.append({"token": s, "logprob": max(lp, -9999.0), "bytes": _bytes(s),
                            "top_logprobs": [{"token": (t := self._tok(i)), "logprob": max(v, -9999.0),
                                              "bytes": _bytes(t)} for i, v in top[:k]]})
        return {"content": content}

    def _decode_lp(self, lp: dict | None) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        if not lp:
            return [], [], []
        return ([_token_id(t) for t in lp["tokens"]], [v if v is not None else -9999.0 for v in lp["token_logprobs"]],
                [self._entries(d or {}) for d in lp["top_logprobs"]])

    def _first_lp(self) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        return [self.token_id], [self.logprobs[0][1]], [self._first_entries()]

    # ---- non-streamed answers ----
    def merge(self, resp: dict) -> dict:
        """The decode's completion of prompt + [t1] -> the client's answer, t1 included."""
        choice = resp["choices"][0]
        tokens = None
        if self.plan.num_logprobs is not None:
            t, l, tops = self._first_lp()
            dt, dl, dtops = self._decode_lp(choice.get("logprobs"))
            tokens = t + dt, l + dl, tops + dtops
        base = {"id": resp.get("id"), "created": resp.get("created"), "model": resp.get("model"),
                "usage": _usage(resp.get("usage"), self.cached_tokens),
                "system_fingerprint": resp.get("system_fingerprint")}
        return self._answer(base, self.text + (choice.get("text") or ""), tokens,
                            {"finish_reason": choice.get("finish_reason"), "stop_reason": choice.get("stop_reason")})

    def alone(self, request_id: str, model: str, finish_reason: str, stop_reason) -> dict:
        """The client's answer when t1 is all of it (a server without a decode)."""
        base = {"id": "cmpl-" + request_id, "created": int(time.time()), "model": model,
                "usage": self.alone_usage(), "system_fingerprint": None}
        tokens = self._first_lp() if self.plan.num_logprobs is not None else None
        return self._answer(base, self.text, tokens, {"finish_reason": finish_reason, "stop_reason": stop_reason})

    def alone_usage(self) -> dict:
        """The usage of an answer that t1 is all of, as vLLM counts it."""
        n = self.num_prompt_tokens
        return with_cached_tokens({"prompt_tokens": n, "total_tokens": n + 1, "completion_tokens": 1},
                                  self.cached_tokens)

    def _answer(self, base: dict, text: str, tokens: tuple | None, finish: dict) -> dict:
        """A whole answer as vLLM 0.32 writes it (``tokens``: what the logprobs are of, or None)."""
        logprobs = None
        if tokens is not None:
            logprobs = self._chat_lp(*tokens) if self.plan.kind == "chat" else self._completion_lp(*tokens, 0)[0]
        base = {**base, **dict.fromkeys(_NULLS)}
        prompt_ids, token_ids = self._shown_ids()
        if self.plan.kind == "completion":
            return {**base, "object": "text_completion",
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, **finish,
                                 **dict.fromkeys(_COMPLETION_CHOICE_NULLS), **prompt_ids, **token_ids}]}
        base["id"] = "chatcmpl-" + str(base["id"] or uuid.uuid4().hex).removeprefix("cmpl-")
        return {**base, "object": "chat.completion", **dict.fromkeys(_CHAT_NULLS),
                **prompt_ids,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                     **dict.fromkeys(_MESSAGE_NULLS)},
                             "logprobs": logprobs, **finish, **dict.fromkeys(_CHAT_CHOICE_NULLS),
                             **token_ids}]}

    def _shown_ids(self) -> tuple[dict, dict]:
        """``return_token_ids``: vLLM's ({"prompt_token_ids": ...}, {"token_ids": [t1]}); ({}, {}) where
        not asked."""
        if self.shown_prompt_ids is None:
            return {}, {}
        return {"prompt_token_ids": list(self.shown_prompt_ids)}, {"token_ids": [self.token_id]}

    # ---- streamed answers ----
    def stream_start(self, request_id: str | None = None) -> "StreamState":
        """``request_id``: the id the chunks carry (as the whole answer's would); a new one where None."""
        return StreamState(self, request_id)


class StreamState:
    """Turns the decode's SSE events into the client's, t1 first. The decode's events come with the
    usage the client asked for already (``stream_relay.StreamUsage`` cuts the rest): each event's
    usage and system_fingerprint are carried over, t1 counted as completion."""

    def __init__(self, ft: FirstToken, request_id: str | None = None):
        self.ft = ft
        self.id = ("chatcmpl-" if ft.plan.kind == "chat" else "cmpl-") + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        self.model: str | None = None  # the served name (as clients name the model here)
        self.offset = 0  # completion logprobs: text offset of the next token

    def _chunk(self, choices: list[dict], **extra) -> bytes:
        obj = "chat.completion.chunk" if self.ft.plan.kind == "chat" else "text_completion"
        ev = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
              "choices": choices, **extra}
        return sse(ev)

    def _choice(self, text: str, tokens: tuple, finish_reason: str | None, stop_reason) -> dict:
        """One choice as vLLM 0.32's stream generators write it: a chat chunk names stop_reason on
        its finishing chunk only, a completion chunk on every one; both carry their null fields."""
        ft = self.ft
        lp = None
        if ft.plan.num_logprobs is not None:
            if ft.plan.kind == "chat":
                lp = ft._chat_lp(*tokens)
            else:
                lp, self.offset = ft._completion_lp(*tokens, self.offset)
        if ft.plan.kind == "chat":
            fin = {"finish_reason": finish_reason}
            if finish_reason is not None:
                fin["stop_reason"] = stop_reason
            return {"index": 0, "delta": {"content": text}, "logprobs": lp, **fin, "token_ids": None}
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason, "stop_reason": stop_reason,
                **dict.fromkeys(_STREAM_COMPLETION_CHOICE_NULLS)}

    def first(self, model: str, finish_reason: str | None = None, stop_reason=None) -> bytes:
        """The events sent before any of the decode's: (chat: the role) then t1 (``finish_reason``:
        t1 ends the answer, a server without a decode)."""
        self.model = model
        ft, out = self.ft, b""
        prompt_ids, token_ids = ft._shown_ids()  # (vLLM: the prompt's in the first chunk, a token's in its own)
        if ft.plan.kind == "chat":
            out += self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], **self._running_usage(0),
                               **{**dict.fromkeys(_STREAM_CHAT_FIRST_NULLS), **prompt_ids})
            prompt_ids = {}
        tokens = ft._first_lp() if ft.plan.num_logprobs is not None else None
        choice = {**self._choice(ft.text, tokens, finish_reason, stop_reason), **prompt_ids, **token_ids}
        return out + self._chunk([choice], **self._running_usage(1))

    def usage(self) -> bytes:
        """The last event of an answer that t1 ends, when ``stream_options.include_usage`` asks."""
        return self._chunk([], usage=self.ft.alone_usage())

    def _running_usage(self, completion_tokens: int) -> dict:
        """``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries
        the usage so far, as vLLM's do (the decode's later chunks carry theirs)."""
        if not (usage_asked(self.ft.plan.body.get("stream_options")) or (False, False))[1]:
            return {}
        n = self.ft.num_prompt_tokens
        u = {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}
        if self.ft.plan.kind == "chat":
            u["completion_tokens_details"] = None
        return {"usage": with_cached_tokens(u, self.ft.cached_tokens)}

    def event(self, data: str | dict) -> bytes:
        """One of the decode's ``data:`` payloads (or the event, parsed) -> the client's event(s)."""
        ev = data
        if isinstance(data, str):
            try:
                ev = json.loads(data)
            except ValueError:  # [DONE], or anything else that is not an event to rewrite
                ev = None
        if not isinstance(ev, dict) or "error" in ev:
            return sse(data)  # (as it came)
        extra = {}
        if ev.get("usage") is not None:
            extra["usage"] = _usage(ev["usage"], self.ft.cached_tokens)
            if self.ft.plan.kind == "chat" and ev.get("choices"):  # (vLLM's chat chunks name it, as null)
                extra["usage"].setdefault("completion_tokens_details", None)
        if ev.get("system_fingerprint") is not None:  # (vLLM's last chunk carries it)
            extra["system_fingerprint"] = ev["system_fingerprint"]
        choices = []
        for c in ev.get("choices") or []:
            tokens = self.ft._decode_lp(c.get("logprobs")) if self.ft.plan.num_logprobs is not None else None
            choices.append(self._choice(c.get("text") or "", tokens, c.get("finish_reason"), c.get("stop_reason")))
        return self._chunk(choices, **extra)


def _usage(u: dict | None, cached_tokens: int | None = None) -> dict | None:
    """The decode counted t1 as prompt; the client's answer counts it as completion."""
    if not u:
        return u
    u = dict(u)
    u["prompt_tokens"] = u.get("prompt_tokens", 1) - 1
    u["completion_tokens"] = u.get("completion_tokens", 0) + 1
    return with_cached_tokens(u, cached_tokens)


def with_cached_tokens(usage: dict, cached_tokens: int | None) -> dict:
    """``usage`` saying in ``prompt_tokens_details.cached_tokens`` how many prompt tokens the
    prefill took from its prefix cache (what made this answer's first token faster); unchanged
    without a prefix cache."""
    if cached_tokens is None or not isinstance(usage, dict):
        return usage
    details = usage.get("prompt_tokens_details")
    return {**usage, "prompt_tokens_details": {**(details if isinstance(details, dict) else {}),
                                               "cached_tokens": cached_tokens}}


def _token_id(s: str) -> int:
    return int(s.removeprefix("token_id:"))


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def first_token(p: Plan, tokenizer, eos_ids: tuple[int, ...], prompt_ids: list[int], token_id: int,
                logprobs, max_model_len: int) -> FirstToken | None:
    """t1 as the client will see it, or None when t1 cannot be sent ahead (it ends the request, it
    is not whole text, or prompt + [t1] would not fit the decode's context)."""
    b = p.body
    if (token_id in eos_ids and not b.get("ignore_eos")) or token_id in (b.get("stop_token_ids") or ()):
        return None
    if len(prompt_ids) + 2 > max_model_len:
        return None
    text = tokenizer.continuation_text(prompt_ids, token_id, b.get("skip_special_tokens", True) is not False)
    if not text:
        return None  # an incomplete character, or a special token the answer would not show
    if p.num_logprobs is not None and not logprobs:
        return None
    return FirstToken(p, token_id, text, logprobs, len(prompt_ids), tokenizer, max_model_len=max_model_len)

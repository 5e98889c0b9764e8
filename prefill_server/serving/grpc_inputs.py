"""A gRPC ``PrefillRequest`` -> the engine's inputs: which input it carries, its sampling, its chat
(``messages`` or a whole OpenAI chat body in ``chat_json``), each checked with the field named."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from prefill_server.engine.worker import SamplingParams
from prefill_server.errors import InvalidRequest
from prefill_server.serving import openai_schema as schema
from prefill_server.serving.pb import prefill_pb2 as pb

_GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: logits / 1e-30 overflow to inf and the softmax to NaN
_TOP_P_MIN = 1e-6


@dataclass
class Prepared:
    request_id: str
    input_field: str  # token_ids | text | messages | chat_json
    token_ids: list[int]
    sampling: SamplingParams
    tokenize_s: float
    t0: float  # time.monotonic() when the call arrived
    cache_salt: str | None = None  # the request's (None: none)


def sampling_params(s: pb.SamplingParams) -> SamplingParams:
    t = s.temperature if s.HasField("temperature") else 0.0
    if not (math.isfinite(t) and t >= 0.0):
        raise InvalidRequest(f"must be a finite number >= 0 (0 = greedy), not {t}", field="sampling.temperature")
    if t < _GREEDY_BELOW:
        t = 0.0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (0.0 < top_p <= 1.0):
        raise InvalidRequest(f"must be in (0, 1], not {top_p}", field="sampling.top_p")
    top_k = s.top_k if s.HasField("top_k") else -1
    if top_k < -1:
        raise InvalidRequest(f"must be >= 1, or 0 / -1 for off, not {top_k}", field="sampling.top_k")
    if top_p < _TOP_P_MIN:  # keeps only the most likely token; below float32's range it would keep none
        top_p, top_k = 1.0, 1
    seed = s.seed if s.HasField("seed") else None
    if seed is not None and seed < 0:
        raise InvalidRequest(f"must be >= 0, not {seed}", field="sampling.seed")
    return SamplingParams(temperature=t, top_p=top_p, top_k=top_k if top_k > 0 else -1, seed=seed)


def input_field(req: pb.PrefillRequest) -> str:
    given = [name for name, present in (("token_ids", len(req.token_ids) > 0), ("text", req.text != ""),
                                        ("messages", len(req.messages) > 0), ("chat_json", req.chat_json != ""))
             if present]
    if not given:
        raise InvalidRequest("the input is empty: set one of token_ids, text, messages or chat_json", field="input")
    if len(given) > 1:
        raise InvalidRequest(f"set exactly one of token_ids, text, messages or chat_json, not {' and '.join(given)}",
                             field="input")
    return given[0]


def chat_request(text: str) -> tuple[list[dict], dict]:
    """``chat_json`` -> (messages for the template, the body whose rendering fields apply), checked
    by the HTTP chat endpoint's rules (its errors name the body's fields: see ``in_chat_json``)."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"not valid JSON ({e}): send an OpenAI chat request body as a JSON object",
                             field="body") from None
    return schema.chat_messages(schema.parse(schema.ChatBody, raw)), raw


def chat_salt(field: str | None, body: str | None) -> str | None:
    """The salt of a ``chat_json`` request: its ``cache_salt`` field or the body's (both checked), which
    isolates the prompt's cached KV as the body asks; two different ones are refused."""
    if field is not None and body is not None and field != body:
        raise InvalidRequest("cache_salt is set twice, differently (the request's field and chat_json's): "
                             "send one of them", field="cache_salt")
    return field if field is not None else body


def in_chat_json(e: InvalidRequest) -> InvalidRequest:
    """A chat body's error (its parsing, rendering or length check) named as a ``chat_json`` field."""
    e.field = "chat_json" if e.field in (None, "", "body", "prompt") else f"chat_json.{e.field}"
    return e


def chat_messages(req: pb.PrefillRequest) -> list[dict]:
    """Any role, as HTTP and vLLM take it: a custom one (``ipython``, ``function``) reaches the chat
    template as it came, and a template that refuses it gives INVALID_ARGUMENT (field ``messages``)."""
    return [{"role": m.role, "content": m.content} for m in req.messages]

"""What the sync and asyncio clients share: request building, result types, channel set-up, errors."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

import grpc

from prefill_server.serving.pb import prefill_pb2 as pb

DEFAULT_TARGET = "127.0.0.1:50051"
MAX_MESSAGE_BYTES = 64 * 2**20
_MODE_NAMES = {pb.TRANSFER_MODE_NIXL_PULL: "nixl-compat", pb.TRANSFER_MODE_PUSH: "connector",
               pb.TRANSFER_MODE_LOCAL: "local"}
_MODES = {v: k for k, v in _MODE_NAMES.items()}


class PrefillRpcError(Exception):
    """A failed call: ``code`` (grpc.StatusCode), ``message``, and for INVALID_ARGUMENT the ``field``
    path the server blamed (e.g. "sampling.temperature")."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None,
                 error_type: str | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message, self.field, self.error_type = code, message, field, error_type

    @classmethod
    def from_rpc_error(cls, e: grpc.RpcError) -> "PrefillRpcError":
        md = {k: v for k, v in (e.trailing_metadata() or ())}
        return cls(e.code(), e.details() or "", md.get("prefill-error-field"), md.get("prefill-error-type"))


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    first_token_text: str
    kv_transfer_params: dict  # pass verbatim as "kv_transfer_params" in the decode's request body
    model: str  # the served model id (send it to the decode as "model")
    transfer_mode: str  # nixl-compat | connector | local
    prompt_tokens: int
    cached_tokens: int
    timings: dict[str, float]  # tokenize_s, queue_s, prefill_s, total_s
    prompt_token_ids: list[int] | None = None  # with return_prompt_token_ids=True


@dataclass(frozen=True)
class PrefillEvent:
    """One PrefillStream event: kind is queued, started, progress or result (the last one)."""

    kind: str
    elapsed_s: float
    prompt_tokens: int = 0
    requests_ahead: int = 0  # queued
    queue_s: float = 0.0  # started
    tokens_done: int = 0  # progress
    result: PrefillResult | None = field(default=None, repr=False)  # result


def build_request(prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict] | None = None,
                  chat: dict | None = None, model: str | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  request_id: str | None = None, return_prompt_token_ids: bool = False,
                  add_special_tokens: bool | None = None, transfer_mode: str | None = None,
                  cache_salt: str | None = None) -> pb.PrefillRequest:
    """prompt: text or token ids; or messages: [{"role": ..., "content": ...}, ...]; or chat: an
    OpenAI chat request body (messages with tool calls or reasoning, tools, chat_template_kwargs...),
    rendered as the HTTP chat endpoint renders it. cache_salt: the prompt's cached KV is shared only
    with requests of the same salt (vLLM's field). The server validates everything (and names the
    field it rejects)."""
    req = pb.PrefillRequest(model=model or "", request_id=request_id or "",
                            return_prompt_token_ids=return_prompt_token_ids, cache_salt=cache_salt or "")
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.extend(prompt)
    for m in messages or ():
        req.messages.add(role=m["role"], content=m.get("content") or "")
    if chat is not None:
        req.chat_json = json.dumps(chat)
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    s = req.sampling
    if temperature is not None:
        s.temperature = temperature
    if top_p is not None:
        s.top_p = top_p
    if top_k is not None:
        s.top_k = top_k
    if seed is not None:
        s.seed = seed
    if transfer_mode is not None:
        if transfer_mode not in _MODES:
            raise ValueError(f"transfer_mode must be one of {', '.join(_MODES)}, not {transfer_mode!r}")
        req.transfer_mode = _MODES[transfer_mode]
    return req


def to_result(r: pb.PrefillResponse) -> PrefillResult:
    t = r.timings
    return PrefillResult(
        request_id=r.request_id, first_token_id=r.first_token_id, first_token_text=r.first_token_text,
        kv_transfer_params=json.loads(r.kv_transfer_params_json) if r.kv_transfer_params_json else {},
        model=r.model, transfer_mode=_MODE_NAMES.get(r.transfer_mode, str(r.transfer_mode)),
        prompt_tokens=r.usage.prompt_tokens, cached_tokens=r.usage.cached_tokens,
        timings={"tokenize_s": t.tokenize_seconds, "queue_s": t.queue_seconds, "prefill_s": t.prefill_seconds,
                 "total_s": t.total_seconds},
        prompt_token_ids=list(r.prompt_token_ids) or None)


def to_event(e: pb.PrefillEvent) -> PrefillEvent | None:
    kind = e.WhichOneof("event")
    if kind == "queued":
        return PrefillEvent(kind, e.elapsed_seconds, e.queued.prompt_tokens, requests_ahead=e.queued.requests_ahead)
    if kind == "started":
        return PrefillEvent(kind, e.elapsed_seconds, e.started.prompt_tokens, queue_s=e.started.queue_seconds)
    if kind == "progress":
        return PrefillEvent(kind, e.elapsed_seconds, e.progress.prompt_tokens, tokens_done=e.progress.tokens_done)
    if kind == "result":
        return PrefillEvent(kind, e.elapsed_seconds, e.result.usage.prompt_tokens, result=to_result(e.result))
    return None  # an event kind newer than this client: skip it


@dataclass(frozen=True)
class ChannelConfig:
    target: str = DEFAULT_TARGET
    api_key: str | None = None
    tls: bool = False  # implied by root_certificates / client cert
    root_certificates: bytes | None = None  # PEM of the CA that signed the server's certificate
    client_cert: bytes | None = None  # PEM, for mutual TLS
    client_key: bytes | None = None
    options: tuple = ()

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls or self.root_certificates or self.client_cert):
            return None
        return grpc.ssl_channel_credentials(self.root_certificates, self.client_key, self.client_cert)

    def channel_options(self) -> list[tuple]:
        return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *self.options]

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

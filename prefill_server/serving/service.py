"""The serving core shared by the HTTP gateway and the gRPC server: tokenize, validate, prefill."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from prefill_server.backends import TransferBackend
from prefill_server.engine.worker import PrefillRequest, PrefillResult, PrefillWorker, Route, SamplingParams
from prefill_server.errors import InvalidRequest, PromptTooLong, UnknownModel
from prefill_server.serving import chat_render
from prefill_server.serving.decode_tokenizer import ThroughDecode, chat_fields
from prefill_server.serving.token_parity import ParityOutcome, local_chat_ids


@dataclass(frozen=True)
class ModelInfo:
    served_name: str  # the id clients send as "model"
    path: str  # the folder the weights came from
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    dtype: str
    block_size: int
    kv_layout: str = "LBHNC"  # pool page layout: per layer, per block [H, N, K|V]
    max_model_len_source: str = "the model's context"  # or "the decode's --max-model-len"
    prefix_cache: bool = False  # --prefix-cache: KV of repeated prompt heads is reused
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: how pages are stored ("fp8": e4m3, one byte a value)
    lease_ttl_s: float = 30.0  # --lease-ttl: how long handed-over KV waits for a decode to read it


class PrefillService:
    """worker: the prefill engine behind its interface; backend: the transfer mode. parity: what the
    start-up probe of the decodes' tokenizers found and the policy chose (``token_parity.py``):
    tokenize here, or every prompt through a decode, and the decodes' vocabulary size."""

    def __init__(self, worker: PrefillWorker, tokenizer, info: ModelInfo, backend: TransferBackend,
                 first_token: str = "prefill", eos_token_ids: tuple[int, ...] = (),
                 parity: ParityOutcome | None = None):
        self.worker, self.tokenizer, self.info, self.backend = worker, tokenizer, info, backend
        self.metrics = worker.metrics
        self.first_token = first_token  # "prefill" | "decode" (backends.first_token_mode)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(eos_token_ids) + ((eos,) if eos is not None and eos not in eos_token_ids else ())
        self.through_decode = ThroughDecode(list(parity.through_decode), self.metrics) \
            if parity is not None and parity.through_decode else None
        self.decode_vocab_size = parity.vocab_size if parity is not None else None
        for r in parity.reports if parity is not None else ():
            self.metrics.tokenizer_parity.labels(r.url).set(1 if r.same else 0)
        # a walk over the vocabulary (~0.1 s): here, not on the event loop under the first request
        getattr(tokenizer, "max_token_chars", None)

    def check_model(self, name: str | None) -> None:
        """``name`` absent, null or "" is the served model, as vLLM takes it."""
        if name and name not in (self.info.served_name, self.info.path):
            raise UnknownModel(f"model {name!r} is not served here; use {self.info.served_name!r}",
                               field="model")

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """With this server's tokenizer (``encode_prompt_async`` follows --tokenizer-parity)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty: send some text", field="prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return self.check_token_ids(list(prompt))

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """With this server's tokenizer and template (``encode_chat_async`` follows --tokenizer-parity)."""
        return local_chat_ids(self.tokenizer, messages, template_kwargs, check_text=self.check_text_length)

    def check_token_ids(self, ids: list[int]) -> list[int]:
        """Ids sent as such are not tokenized, but the decode must take them too: below its vocabulary
        size (the engine checks the model's)."""
        limit = self.decode_vocab_size
        if limit is not None and ids and (min(ids) < 0 or max(ids) >= limit):
            bad = next(t for t in ids if not 0 <= t < limit)
            raise InvalidRequest(f"token id {bad} is outside the decode's vocabulary [0, {limit}): send ids "
                                 "of the served model's tokenizer", field="prompt")
        return ids

    def check_text_length(self, text: str) -> None:
        """Refuse, before tokenizing it, a text too long to fit the context whatever its tokens:
        no token covers more than ``max_token_chars`` characters (with a margin for normalizers
        that shorten text), so the bound is exact in direction, never refusing a prompt that fits."""
        limit = self.info.max_model_len * self.tokenizer.max_token_chars * 4
        if len(text) > limit:
            raise PromptTooLong(f"the prompt has {len(text)} characters, which is more than {self.info.max_model_len} "
                                f"tokens ({self.info.max_model_len_source}) whatever its tokens: shorten it",
                                field="prompt")

    async def encode_prompt_async(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids: ids as sent (checked), text off the event loop (a long prompt takes long to
        tokenize), or by the decode's /tokenize with --tokenizer-parity decode."""
        if not isinstance(prompt, str):
            return self.encode_prompt(prompt)
        self.check_text_length(prompt)
        if self.through_decode is not None and prompt:
            return await self.through_decode.encode(prompt, add_special_tokens)
        return await asyncio.to_thread(self.encode_prompt, prompt, add_special_tokens)

    async def encode_chat_async(self, messages: list[dict], request: dict | None = None) -> list[int]:
        """A chat's ids, after a length check on the messages' text: rendered and tokenized off the
        event loop, or by the decode's /tokenize with --tokenizer-parity decode. ``request``: the
        client's chat body (validated), whose messages and rendering fields the decode is sent as they
        came (it renders them itself when it answers the chat): rendered here by the same rules
        (``chat_render``), or by the decode's /tokenize as they are."""
        self.check_text_length("".join(str(m.get("content") or "") for m in messages))
        if self.through_decode is not None:
            if request is not None:
                return await self.through_decode.encode_chat(request["messages"], chat_fields(request))
            return await self.through_decode.encode_chat(messages, None)
        kwargs = chat_render.template_kwargs(request) if request is not None else {}
        return await asyncio.to_thread(self.encode_chat, messages, **kwargs)

    async def prefill(self, token_ids: list[int], sampling: SamplingParams = SamplingParams(),
                      request_id: str | None = None, num_logprobs: int | None = None,
                      route: Route = Route.LEASE, room_tokens: int = 0, decode_url: str | None = None,
                      cache_salt: str | None = None) -> PrefillResult:
        """Prefill and hand the KV over (route LEASE or LEASE_FOR_LATER); cancelling the awaiting
        task frees everything at once. num_logprobs: also return the first token's logprobs
        (sampled + top num_logprobs). room_tokens: KV positions leased past the prompt, for a
        decode sent more tokens (``params_for_prompt``). decode_url: the decode that will read it.
        cache_salt: the client's (vLLM's field): the prompt's cached blocks are shared only with
        requests of the same salt."""
        rid = request_id or f"pf-{uuid.uuid4().hex}"
        fut = self.worker.submit(PrefillRequest(rid, tuple(token_ids), sampling, route=route,
                                                num_logprobs=num_logprobs, room_tokens=room_tokens,
                                                decode_url=decode_url, cache_salt=cache_salt))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            self.worker.release(rid)
            raise

    async def start_stream(self, token_ids: list[int], sampling: SamplingParams = SamplingParams(),
                           request_id: str | None = None, *, bootstrap_room: int | None = None,
                           num_logprobs: int | None = None,
                           cache_salt: str | None = None) -> tuple[str, dict, asyncio.Future]:
        """Route STREAM: queue a streamed prefill; returns (request id, the params for the decode's
        request, a future of the PrefillResult). Send the decode its request at once: the prefill
        starts when the decode registers its blocks. ``bootstrap_room``: an SGLang decode's room (a
        router's choice; None: the producer picks one); ``num_logprobs``: the first token's, for a
        decode that reads them from us (SGLang's aux row); ``cache_salt``: as ``prefill``'s."""
        rid = request_id or f"pf-{uuid.uuid4().hex}"
        params, result = self.worker.start_stream(PrefillRequest(rid, tuple(token_ids), sampling, route=Route.STREAM,
                                                                 num_logprobs=num_logprobs,
                                                                 bootstrap_room=bootstrap_room,
                                                                 cache_salt=cache_salt))
        try:
            return rid, await asyncio.wrap_future(params), asyncio.wrap_future(result)
        except BaseException:  # the client went away, or the worker refused it
            result.cancel()
            self.worker.release(rid)
            raise

    def params_for_prompt(self, params: dict, num_decode_tokens: int) -> dict:
        """A prefill's kv_transfer_params fitted to the prompt the decode is sent (its length in
        tokens): a stock vLLM decode reads exactly as many blocks as it allocates for it."""
        return self.backend.params_for_prompt(params, num_decode_tokens, self.info.block_size)

    def fits_whole(self, num_tokens: int) -> bool:
        """Whether the pool can hold a whole prompt's KV (what computing it before the decode needs)."""
        return self.worker.fits_whole(num_tokens)

    def release(self, request_id: str) -> bool:
        return self.worker.release(request_id)

    def keep(self, request_ids: list[str]) -> None:
        """Hold these requests' leased KV another lease TTL (their decode calls are open)."""
        self.worker.keep(request_ids, self.info.lease_ttl_s)

    def refuse_room(self, room: int, reason: str) -> None:
        """An SGLang PD request refused here: the decode the router sent it too fails it at once."""
        refuse = getattr(self.worker, "refuse_room", None)  # (one engine in this process: SGLang's only setup)
        if refuse is not None:
            refuse(room, reason)

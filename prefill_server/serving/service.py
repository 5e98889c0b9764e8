"""The serving core shared by the HTTP gateway and the gRPC server: tokenize, validate, prefill."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from prefill_server.backends import TransferBackend
from prefill_server.engine.worker import PrefillRequest, PrefillResult, PrefillWorker, Route, SamplingParams
from prefill_server.errors import InvalidRequest, PromptTooLong, UnknownModel


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


class PrefillService:
    """worker: the prefill engine behind its interface; backend: the transfer mode."""

    def __init__(self, worker: PrefillWorker, tokenizer, info: ModelInfo, backend: TransferBackend,
                 first_token: str = "prefill", eos_token_ids: tuple[int, ...] = ()):
        self.worker, self.tokenizer, self.info, self.backend = worker, tokenizer, info, backend
        self.metrics = worker.metrics
        self.first_token = first_token  # "prefill" | "decode" (backends.first_token_mode)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(eos_token_ids) + ((eos,) if eos is not None and eos not in eos_token_ids else ())

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.info.served_name, self.info.path):
            raise UnknownModel(f"model {name!r} is not served here; use {self.info.served_name!r}",
                               field="model")

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty: send some text", field="prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        self.check_text_length(text)
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template holds the specials

    def check_text_length(self, text: str) -> None:
        """Refuse, before tokenizing it, a text too long to fit the context whatever its tokens:
        no token covers more than ``max_token_chars`` characters (with a margin for normalizers
        that shorten text), so the bound is exact in direction, never refusing a prompt that fits."""
        limit = self.info.max_model_len * self.tokenizer.max_token_chars * 4
        if len(text) > limit:
            raise PromptTooLong(f"the prompt has {len(text)} characters, which is more than {self.info.max_model_len} "
                                f"tokens ({self.info.max_model_len_source}) whatever its tokens: shorten it",
                                field="prompt")

    async def encode_prompt_async(self, prompt: str | list[int]) -> list[int]:
        """``encode_prompt`` off the event loop (a long prompt takes long to tokenize)."""
        if isinstance(prompt, str):
            self.check_text_length(prompt)
            return await asyncio.to_thread(self.encode_prompt, prompt)
        return self.encode_prompt(prompt)

    async def encode_chat_async(self, messages: list[dict], **template_kwargs) -> list[int]:
        """``encode_chat`` off the event loop, after the same length check on the messages' text."""
        self.check_text_length("".join(str(m.get("content") or "") for m in messages))
        return await asyncio.to_thread(self.encode_chat, messages, **template_kwargs)

    async def prefill(self, token_ids: list[int], sampling: SamplingParams = SamplingParams(),
                      request_id: str | None = None, num_logprobs: int | None = None,
                      route: Route = Route.LEASE, room_tokens: int = 0, decode_url: str | None = None) -> PrefillResult:
        """Prefill and hand the KV over (route LEASE or LEASE_FOR_LATER); cancelling the awaiting
        task frees everything at once. num_logprobs: also return the first token's logprobs
        (sampled + top num_logprobs). room_tokens: KV positions leased past the prompt, for a
        decode sent more tokens (``params_for_prompt``). decode_url: the decode that will read it."""
        rid = request_id or f"pf-{uuid.uuid4().hex}"
        fut = self.worker.submit(PrefillRequest(rid, tuple(token_ids), sampling, route=route,
                                                num_logprobs=num_logprobs, room_tokens=room_tokens,
                                                decode_url=decode_url))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            self.worker.release(rid)
            raise

    async def start_stream(self, token_ids: list[int], sampling: SamplingParams = SamplingParams(),
                           request_id: str | None = None) -> tuple[str, dict, asyncio.Future]:
        """Route STREAM: queue a streamed prefill; returns (request id, kv_transfer_params for
        the decode, a future of the PrefillResult). Send the decode its request at once: the
        prefill starts when the decode's connector registers its blocks."""
        rid = request_id or f"pf-{uuid.uuid4().hex}"
        params, result = self.worker.start_stream(PrefillRequest(rid, tuple(token_ids), sampling,
                                                                 route=Route.STREAM))
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

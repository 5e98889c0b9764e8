"""Messages between the serving layer and the engine (plain dataclasses, no transport types)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.base import Route
from prefill_server.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    """How the first token is chosen (the decode samples the rest itself)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    seed: int | None = None
    min_p: float = 0.0  # 0 = off
    # over the prompt's tokens (vLLM's rule; SGLang's counts output tokens only, so 1.0 for its decodes)
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] | None = None  # None = every token
    # token ids the first token may not be: the stop tokens while a request's min_tokens is not reached
    banned_token_ids: tuple[int, ...] = ()
    # (token ids outside the vocabulary are ignored here: the serving layer refuses them)
    sampler: str = "vllm"  # whose top-k / top-p / min-p rules draw it: "vllm", or "sglang" for its decodes

    def validate(self) -> None:
        if not (self.temperature >= 0.0):
            raise InvalidRequest("temperature must be >= 0", field="temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest("top_p must be in (0, 1]", field="top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest("top_k must be -1 (off) or a positive integer", field="top_k")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequest("min_p must be in [0, 1]", field="min_p")
        if not (self.repetition_penalty > 0.0):
            raise InvalidRequest("repetition_penalty must be > 0", field="repetition_penalty")
        if self.sampler not in ("vllm", "sglang"):
            raise InvalidRequest("sampler must be 'vllm' or 'sglang'", field="sampler")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequest("allowed_token_ids must not be empty", field="allowed_token_ids")


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    route: Route = Route.LEASE  # how its KV leaves the engine (kv_transfer.base.Route)
    num_logprobs: int | None = None  # first token's logprobs: None = none, k = sampled + top k
    # KV room leased past the prompt, in tokens: a decode that continues from prompt + [first token]
    # allocates blocks for that position too, and a stock vLLM decode asserts that the prefill
    # offers as many blocks as it allocated (it computes the position's KV itself)
    room_tokens: int = 0
    # route LEASE: the decode that will read the KV (its side channel and compatibility hash are
    # in the params); None = the producer's only (or first) decode
    decode_url: str | None = None
    # route STREAM to an SGLang decode: the room its request carries (a PD router's choice); None =
    # the producer picks one and returns it in the params
    bootstrap_room: int | None = None
    # the client's ``cache_salt`` (vLLM's field): prefix-cache blocks shared only with the same salt
    cache_salt: str | None = None


@dataclass
class Timings:
    queued_s: float = 0.0  # submit -> first scheduled
    prefill_s: float = 0.0  # first scheduled -> last chunk computed
    total_s: float = 0.0  # submit -> result ready (KV published)

    def as_dict(self) -> dict[str, float]:
        return {"queued_s": self.queued_s, "prefill_s": self.prefill_s, "total_s": self.total_s}


@dataclass
class PrefillResult:
    request_id: str
    first_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_transfer_params: dict
    timings: Timings = field(default_factory=Timings)
    # ((token id, logprob), ...): the sampled token first, then the top num_logprobs (vLLM's order)
    first_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load, for routing (``PrefillWorker.load``)."""

    waiting: int  # requests queued
    running: int  # requests being computed
    pending_tokens: int  # prompt tokens still to compute (queued and the rest of the running)
    free_blocks: int
    total_blocks: int
    block_size: int
    tokens_per_s: float | None  # measured throughput (None until measured)

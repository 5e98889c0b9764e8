"""Messages between the serving layer and the engine (plain dataclasses, no transport types)."""
from __future__ import annotations

from dataclasses import dataclass, field

from prefill_server.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    """How the first token is chosen (the decode samples the rest itself)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    seed: int | None = None

    def validate(self) -> None:
        if not (self.temperature >= 0.0):
            raise InvalidRequest("temperature must be >= 0", field="temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest("top_p must be in (0, 1]", field="top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest("top_k must be -1 (off) or a positive integer", field="top_k")


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    push: bool = False  # connector mode: stream each layer into the decode's blocks (one step)
    # connector mode: compute now, lease the KV; the decode registers afterwards and pulls it
    pull_later: bool = False
    num_logprobs: int | None = None  # first token's logprobs: None = none, k = sampled + top k
    # KV room leased past the prompt, in tokens: a decode that continues from prompt + [first token]
    # allocates blocks for that position too, and a stock vLLM decode asserts that the prefill
    # offers as many blocks as it allocated (it computes the position's KV itself)
    room_tokens: int = 0


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

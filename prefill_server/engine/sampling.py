"""First-token sampling (greedy, temperature, top-k, top-p) on one logits row."""
from __future__ import annotations

import torch

from prefill_server.engine.types import SamplingParams

SAMPLING_EPS = 1e-5


def sample_first_token(logits: torch.Tensor, params: SamplingParams) -> int:
    """logits [V] float32 -> token id."""
    if params.temperature < SAMPLING_EPS:  # as vLLM: tiny temperatures are greedy (no overflow)
        return int(torch.argmax(logits))
    x = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(x, min(params.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < params.top_p
        keep[0] = True  # always keep the top token, however small top_p is
        probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
    gen = torch.Generator(device="cpu")
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


MAX_LOGPROBS = 20  # vLLM's default max_logprobs


def first_token_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[tuple[int, float], ...]:
    """logits [V] float32 -> ((token, logprob), (top-1 id, logprob), ..., (top-k id, logprob)),
    computed as vLLM's sampler does (raw logits, float32 log_softmax, torch.topk)."""
    logprobs = logits.float().log_softmax(dim=-1)
    out = [(token, float(logprobs[token]))]
    if k > 0:
        vals, ids = torch.topk(logprobs, min(k, logprobs.numel()))
        out += [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return tuple(out)

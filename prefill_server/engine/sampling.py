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

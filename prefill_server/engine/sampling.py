"""First-token sampling (banned tokens, greedy, temperature, top-k, top-p) on one logits row."""
from __future__ import annotations

import torch

from prefill_server.engine.types import SamplingParams
from prefill_server.errors import InvalidRequest

SAMPLING_EPS = 1e-5


def sample_first_token(logits: torch.Tensor, params: SamplingParams) -> int:
    """logits [V] float32 -> token id. Banned tokens are masked first, as vLLM's min-tokens logits
    processor masks the stop tokens (before temperature and the top-k / top-p filters)."""
    if params.banned_token_ids:
        v = logits.numel()
        banned = [t for t in params.banned_token_ids if 0 <= t < v]
        if banned:
            logits = logits.clone()
            logits[torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
            if not bool(torch.isfinite(logits).any()):
                raise InvalidRequest("every token is a stop token while min_tokens is not reached: lower min_tokens "
                                     "or send fewer stop_token_ids", field="min_tokens")
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

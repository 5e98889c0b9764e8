"""First-token sampling on one logits row, in the order of vLLM v1's sampler: allowed token ids,
banned tokens and logit bias, the repetition penalty over the prompt, then greedy, or temperature,
min-p, top-k, top-p. For an SGLang decode (``SamplingParams.sampler == "sglang"``) the filters after
temperature follow SGLang's sampler instead: top-k and top-p together on the whole distribution, or,
with min-p, top-k, top-p on what top-k left, then min-p (its default FlashInfer backend)."""
from __future__ import annotations

import torch

from prefill_server.engine.types import SamplingParams
from prefill_server.errors import InvalidRequest

SAMPLING_EPS = 1e-5


def sample_first_token(logits: torch.Tensor, params: SamplingParams, prompt_ids: tuple[int, ...] = ()) -> int:
    """logits [V] float32 -> token id (``prompt_ids``: for the repetition penalty)."""
    x = draw_logits(logits, params, prompt_ids)
    if params.temperature < SAMPLING_EPS:
        return int(torch.argmax(x))
    gen = torch.Generator(device="cpu")
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return int(torch.multinomial(torch.softmax(x, dim=-1).cpu(), 1, generator=gen))


def draw_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """The logits [V] the token is drawn from (-inf: never drawn): greedy takes their argmax (tiny
    temperatures too, as in vLLM: no overflow), sampling their softmax."""
    x = _processed(logits, params, prompt_ids)
    if params.temperature < SAMPLING_EPS:
        return x
    x = x.float() / params.temperature
    if params.sampler == "sglang":
        return _sglang_filters(x, params)
    if params.min_p > 0.0:  # (vLLM: after temperature, before top-k / top-p)
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0:
        kth = torch.topk(x, min(params.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sp, si = torch.sort(torch.softmax(x, dim=-1), descending=True)
        keep = torch.cumsum(sp, 0) - sp < params.top_p
        keep[0] = True  # always keep the top token, however small top_p is
        x = _keep_sorted(x, si, keep)
    return x


def _sglang_filters(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """x [V] (after temperature) -> the same with every token SGLang's sampler would not draw at -inf.
    Without min-p both of its backends keep the tokens inside top-k and inside top-p of the whole
    distribution (FlashInfer's "joint" order; its PyTorch backend likewise). With min-p, FlashInfer
    renormalizes after top-k, takes top-p of that, then min-p against the largest probability."""
    sp, si = torch.sort(torch.softmax(x, dim=-1), descending=True)
    keep = torch.ones_like(sp, dtype=torch.bool)  # (each filter keeps the top token)
    if p.top_k > 0:
        keep[p.top_k:] = False
    if p.top_p < 1.0:
        base = sp * keep / (sp * keep).sum() if p.min_p > 0.0 else sp
        keep &= torch.cumsum(base, 0) - base <= p.top_p
    if p.min_p > 0.0:
        keep &= sp >= sp[0] * p.min_p
    return _keep_sorted(x, si, keep)


def _keep_sorted(x: torch.Tensor, order: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x [V] with -inf wherever ``keep`` [V] (in ``order``, x's indices sorted) is False."""
    drop = torch.ones_like(keep)
    drop[order[keep]] = False
    return x.masked_fill(drop, float("-inf"))


def _processed(logits: torch.Tensor, p: SamplingParams, prompt_ids: tuple[int, ...]) -> torch.Tensor:
    """The logits the token is drawn from (the caller's row is left as it is: logprobs are the raw
    ones, as vLLM's default ``raw_logprobs``)."""
    if p.allowed_token_ids is None and not p.banned_token_ids and not p.logit_bias and p.repetition_penalty == 1.0:
        return logits
    x = logits.float().clone()
    v = x.numel()

    def index(ids) -> torch.Tensor:
        return torch.tensor([t for t in ids if 0 <= t < v], dtype=torch.long, device=x.device)

    if p.allowed_token_ids is not None:
        keep = torch.zeros(v, dtype=torch.bool, device=x.device)
        keep[index(p.allowed_token_ids)] = True
        x = x.masked_fill(~keep, float("-inf"))
    if p.banned_token_ids:
        x[index(p.banned_token_ids)] = float("-inf")
    if p.logit_bias:
        pairs = [(t, b) for t, b in p.logit_bias if 0 <= t < v]
        x.index_add_(0, index(t for t, _ in pairs), torch.tensor([b for _, b in pairs], dtype=x.dtype,
                                                                  device=x.device))
    if p.repetition_penalty != 1.0 and prompt_ids:
        seen = torch.as_tensor(prompt_ids, dtype=torch.long).unique()  # (a 1M-token prompt: no Python loop)
        seen = seen[(seen >= 0) & (seen < v)].to(x.device)
        s = x[seen]
        x[seen] = torch.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
    if not bool(torch.isfinite(x).any()):
        if p.allowed_token_ids is not None:
            raise InvalidRequest("no token is left to draw: every allowed token is a stop token, which min_tokens "
                                 "bans; allow more tokens or lower min_tokens", field="allowed_token_ids")
        raise InvalidRequest("no token is left to draw: every token is a stop token while min_tokens is not "
                             "reached; lower min_tokens or send fewer stop_token_ids", field="min_tokens")
    return x


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

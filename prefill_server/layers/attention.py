"""Attention dispatch: dense (fastest available path) or block-sparse for long prompts.

``dense_attention`` computes causal attention of a chunk of queries against all keys of the same
sequence, bottom-right aligned: query i (of Tq) sits at key position Tk - Tq + i. GQA is handled by
the kernels (no K/V repeat) where they allow it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional: the `gpu` extra
    from flash_attn import flash_attn_varlen_func  # type: ignore
except Exception:  # pragma: no cover - depends on the install
    flash_attn_varlen_func = None


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] (Tq <= Tk) -> o [Tq, Hq, D]."""
    tq, tk = q.shape[0], k.shape[0]
    assert tq <= tk, (tq, tk)
    if flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cq = torch.tensor([0, tq], dtype=torch.int32, device=q.device)
        ck = torch.tensor([0, tk], dtype=torch.int32, device=q.device)
        return flash_attn_varlen_func(q, k, v, cq, ck, tq, tk, softmax_scale=scale, causal=True)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
    if tq == tk:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # bottom-right causal: key j visible to query i iff j <= (tk - tq) + i
        qi = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
        mask = torch.arange(tk, device=q.device)[None, :] <= qi  # [Tq, Tk]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)

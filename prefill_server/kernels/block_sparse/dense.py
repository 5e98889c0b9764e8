"""Dense causal attention helpers for the fallback (short prompts, first layers).

``dense_attention``: any packed varlen batch with q_len <= k_len, with LSE: our Triton kernel visiting
every causal block on CUDA (see docs/BENCHMARKS.md for its speed against cuDNN), the reference on CPU.
``sdpa_causal``: one sequence through PyTorch SDPA (cuDNN / FlashAttention on a GPU), output only: the
fastest dense path when the caller needs no LSE.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .layout import Layout, build_layout
from . import reference


def dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, layout: Layout | None = None,
                    scale: float | None = None, block_size: int = 128):
    """(out [Tq, Hq, D], lse [Tq, Hq] float32) of full causal attention."""
    if layout is None:
        layout = build_layout(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], block_size)
    if q.is_cuda:
        from . import kernel
        return kernel.attention(q, k, v, layout, None, None, scale, dense=True)
    return reference.dense_attention(q, k, v, layout, scale)


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
    """One sequence: q [Lq, Hq, D], k/v [Lk, Hkv, D], queries the last Lq key positions -> out [Lq, Hq, D]."""
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if hq != hkv:  # expanded K/V: every SDPA backend takes it (enable_gqa is not on all of them)
        kt = kt.repeat_interleave(hq // hkv, dim=1)
        vt = vt.repeat_interleave(hq // hkv, dim=1)
    if lq == lk:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        from torch.nn.attention.bias import causal_lower_right
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(lq, lk), scale=scale)
    return o[0].transpose(0, 1)

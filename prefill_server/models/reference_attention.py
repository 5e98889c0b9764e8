"""A plain-PyTorch ``AttentionFn`` for a flattened batch without a KV pool: causal attention within
each sequence of ``cu_seqlens``. For tests and a CPU forward; optionally records K/V per layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class CausalAttention:
    def __init__(self, cu_seqlens: torch.Tensor | list[int], record: bool = False,
                 sliding_window: int | None = None, scale: float | None = None):
        """cu_seqlens: [B + 1] cumulative lengths (0, len0, len0 + len1, ...).
        sliding_window: if set, query i sees keys i - window + 1 .. i (HF Mistral convention)."""
        self.cu_seqlens = [int(c) for c in cu_seqlens]
        assert self.cu_seqlens[0] == 0 and all(a <= b for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]))
        self.record = record
        self.sliding_window = sliding_window
        self.scale = scale
        self.keys: dict[int, torch.Tensor] = {}  # layer -> k [T, Hkv, D] (post-rope), when record
        self.values: dict[int, torch.Tensor] = {}  # layer -> v [T, Hkv, D]

    @classmethod
    def single(cls, num_tokens: int, **kw) -> "CausalAttention":
        return cls([0, num_tokens], **kw)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> o [T, Hq, D]."""
        assert q.shape[0] == k.shape[0] == v.shape[0] == self.cu_seqlens[-1], (q.shape, self.cu_seqlens)
        if self.record:
            self.keys[layer], self.values[layer] = k.clone(), v.clone()
        rep = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for s, e in zip(self.cu_seqlens, self.cu_seqlens[1:]):
            if s == e:
                continue
            qs = q[s:e].transpose(0, 1)  # [Hq, L, D]
            ks = k[s:e].repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, L, D]
            vs = v[s:e].repeat_interleave(rep, dim=1).transpose(0, 1)
            if self.sliding_window is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
            else:
                i = torch.arange(e - s, device=q.device)
                diff = i[:, None] - i[None, :]  # query - key
                mask = (diff >= 0) & (diff < self.sliding_window)  # [L, L]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale)
            out[s:e] = o.transpose(0, 1)
        return out

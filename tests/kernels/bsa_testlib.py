"""Shared test data for the block-sparse attention tests (imported by test modules here)."""
from __future__ import annotations

import math

import torch


def structured(t: int, h: int, d: int, bs: int, gen: torch.Generator, scale: float = 1.5,
               dtype=torch.float32, device="cpu") -> torch.Tensor:
    """[t, h, d] noise plus a random offset shared by each block of bs rows: scores then differ
    between blocks, so estimator thresholds cut somewhere in the middle."""
    nb = -(-t // bs)
    c = torch.randn(nb, 1, h, d, generator=gen) * scale
    x = (torch.randn(nb, bs, h, d, generator=gen) + c).reshape(nb * bs, h, d)[:t]
    return x.to(device=device, dtype=dtype)


def batch(q_lens, k_lens, hq, hkv, d, bs, seed=0, dtype=torch.float32, device="cpu", structured_data=False):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(q_lens), sum(k_lens)
    if structured_data:
        q = torch.cat([structured(n, hq, d, bs, gen) for n in q_lens])
        k = torch.cat([structured(n, hkv, d, bs, gen) for n in k_lens])
    else:
        q = torch.randn(tq, hq, d, generator=gen)
        k = torch.randn(tk, hkv, d, generator=gen)
    v = torch.randn(tk, hkv, d, generator=gen)
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0).tolist()), dtype=torch.int32)
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), cu(q_lens).to(device),
            cu(k_lens).to(device))


def brute_force(q, k, v, cu_q, cu_k, sel, bs, scale=None):
    """Independent reference: the full element mask of each sequence, one softmax (float64)."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(tq, hq, d, dtype=torch.float64)
    lse = torch.zeros(tq, hq, dtype=torch.float64)
    slot = 0
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        lq, lk = q1 - q0, k1 - k0
        pos = torch.arange(lq) + lk - lq
        col = torch.arange(lk)
        qb = torch.arange(lq) // bs
        diag_lo = (lk - lq + qb * bs) // bs  # per query: first diagonal-region key block
        blk_sel = sel[slot + qb][:, :, :].cpu()  # [lq, Hkv, cap]
        keep = blk_sel[:, :, (col // bs)]  # [lq, Hkv, lk]
        keep |= ((col // bs)[None, :] >= diag_lo[:, None])[:, None, :]
        keep &= (col[None, :] <= pos[:, None])[:, None, :]
        s = torch.einsum("qhgd,khd->hgqk", q[q0:q1].double().cpu().view(lq, hkv, g, d),
                         k[k0:k1].double().cpu()) * scale
        s = s.masked_fill(~keep.permute(1, 0, 2)[:, None], float("-inf"))
        l = torch.logsumexp(s, -1)
        o = torch.einsum("hgqk,khd->qhgd", torch.exp(s - l[..., None]), v[k0:k1].double().cpu())
        out[q0:q1] = o.reshape(lq, hq, d)
        lse[q0:q1] = l.permute(2, 0, 1).reshape(lq, hq)
        slot += -(-lq // bs)
    return out, lse


def rel_l2(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())

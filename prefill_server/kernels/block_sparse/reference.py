"""Plain-PyTorch references: the block-sparse estimator and masked causal attention with LSE.

Both work per sequence with a host loop (they read ``cu_seqlens`` on the host), in float32, and are
the ground truth the Triton code in ``estimate.py``/``kernel.py`` is tested against. They are also the
CPU execution path (``Plan.run`` on a CPU tensor), so they stay memory-frugal: attention visits only
the key blocks some head of the group kept.

Block masks are in *slot space*: ``sel`` bool [n_slots, Hkv, max_kblocks] (see ``layout.py``); entry
(s, h, j) says query block s keeps key block j for KV head h. Only selectable blocks j < diag_lo(s)
are read; the diagonal region is always computed with the causal mask.
"""
from __future__ import annotations

import math

import torch

from .layout import Layout, slot_geometry


def _seq_ranges(layout: Layout):
    """Host list of (q0, q_len, k0, k_len, first_slot, first_kslot) per sequence (host sync)."""
    cu_q = layout.cu_q.tolist()
    cu_k = layout.cu_k.tolist()
    bs = layout.block_size
    out, slot, kslot = [], 0, 0
    for b in range(layout.batch):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len > k_len:
            raise ValueError(f"sequence {b}: q_len {q_len} > k_len {k_len}; queries must be the last "
                             "q_len positions of the keys")
        out.append((cu_q[b], q_len, cu_k[b], k_len, slot, kslot))
        slot += -(-q_len // bs)
        kslot += -(-k_len // bs)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, sel: torch.Tensor,
              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention restricted to ``sel`` plus the diagonal region.

    q [Tq, Hq, D], k/v [Tk, Hkv, D] -> out [Tq, Hq, D] (q.dtype), lse [Tq, Hq] float32 (natural log).
    """
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    bs = layout.block_size
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(tq, hq, dtype=torch.float32, device=q.device)
    sel = sel.to(q.device)
    for q0, q_len, k0, k_len, slot0, _ in _seq_ranges(layout):
        off = k_len - q_len
        for jb in range(-(-q_len // bs)):
            i0, i1 = jb * bs, min(q_len, jb * bs + bs)
            a, e = off + i0, off + i1 - 1
            lo = a // bs
            blk = sel[slot0 + jb, :, :lo].clone()  # [Hkv, lo]
            cols_blk = torch.nonzero(blk.any(0)).flatten().tolist() + list(range(lo, e // bs + 1))
            cols = torch.cat([torch.arange(c * bs, min(c * bs + bs, k_len), device=q.device)
                              for c in cols_blk])  # key positions visited
            head_ok = torch.ones(hkv, cols.numel(), dtype=torch.bool, device=q.device)
            col_blk = cols // bs
            sel_part = col_blk < lo
            head_ok[:, sel_part] = blk[:, col_blk[sel_part]]
            pos = torch.arange(a, e + 1, device=q.device)
            causal = cols[None, :] <= pos[:, None]  # [n, C]
            mask = head_ok[:, None, None, :] & causal[None, None]  # [Hkv, 1, n, C]
            qs = q[q0 + i0:q0 + i1].float().view(-1, hkv, g, d)  # [n, Hkv, G, D]
            ks = k[k0 + cols].float()  # [C, Hkv, D]
            vs = v[k0 + cols].float()
            s = torch.einsum("nhgd,chd->hgnc", qs, ks) * scale
            s = s.masked_fill(~mask, float("-inf"))
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - m)
            l = p.sum(-1, keepdim=True)
            o = torch.einsum("hgnc,chd->nhgd", p / l, vs)
            out[q0 + i0:q0 + i1] = o.reshape(-1, hq, d).to(q.dtype)
            lse[q0 + i0:q0 + i1] = (m + torch.log(l)).squeeze(-1).permute(2, 0, 1).reshape(-1, hq)
    return out, lse


def dense_attention(q, k, v, layout: Layout, scale: float | None = None):
    """Full causal attention (every selectable block kept)."""
    sel = torch.ones(layout.n_slots, k.shape[1], layout.max_kblocks, dtype=torch.bool, device=q.device)
    return attention(q, k, v, layout, sel, scale)


# ----------------------------------------------------------------------------------------------
# Estimator reference
# ----------------------------------------------------------------------------------------------

def pool_keys(k_seq: torch.Tensor, bs: int) -> torch.Tensor:
    """Mean of each key block: [Lk, Hkv, D] -> [nkb, Hkv, D] in k.dtype (fp32 sums)."""
    lk, h, d = k_seq.shape
    nkb = -(-lk // bs)
    pad = torch.zeros(nkb * bs - lk, h, d, dtype=torch.float32, device=k_seq.device)
    kk = torch.cat([k_seq.float(), pad]).view(nkb, bs, h, d).sum(1)
    cnt = torch.clamp(lk - torch.arange(nkb, device=k_seq.device) * bs, max=bs).float()
    return (kk / cnt[:, None, None]).to(k_seq.dtype)


def pool_queries(q_seq: torch.Tensor, bs: int, pool: int, hkv: int):
    """Pooled queries per query block: [Lq, Hq, D] -> ([nqb, Hkv, G*NP, D] q.dtype, valid [nqb, G*NP]).

    Row r = g*NP + p is the mean of queries [p*pool, (p+1)*pool) of the block for head kvh*G + g."""
    lq, hq, d = q_seq.shape
    g, npool = hq // hkv, bs // pool
    nqb = -(-lq // bs)
    pad = torch.zeros(nqb * bs - lq, hq, d, dtype=torch.float32, device=q_seq.device)
    qq = torch.cat([q_seq.float(), pad]).view(nqb, npool, pool, hkv, g, d).sum(2)  # [nqb,NP,Hkv,G,D]
    tok = torch.arange(nqb * npool, device=q_seq.device).view(nqb, npool) * pool
    cnt = torch.clamp(lq - tok, min=0, max=pool).float()  # [nqb, NP]
    qp = qq / cnt.clamp(min=1)[:, :, None, None, None]
    qp = qp.permute(0, 2, 3, 1, 4).reshape(nqb, hkv, g * npool, d)
    valid = (cnt > 0)[:, None, :].expand(nqb, g, npool).reshape(nqb, g * npool)
    return qp.to(q_seq.dtype), valid


def probe_scores(q_seq, k_seq, n_probe: int, scale: float) -> torch.Tensor:
    """Exact attention of the last ``n_probe`` queries against all keys, summed per key block:
    returns v [nkb, Hkv]: for each KV head, the max over its group's heads of the mean over the
    probe queries of the attention mass on the block."""
    lq, hq, d = q_seq.shape
    lk, hkv, _ = k_seq.shape
    g = hq // hkv
    bs_cols = lk
    n = min(n_probe, lq)
    qs = q_seq[lq - n:].float().view(n, hkv, g, d)
    s = torch.einsum("nhgd,chd->hgnc", qs, k_seq.float()) * scale  # [Hkv, G, n, Lk]
    pos = torch.arange(lk - n, lk, device=q_seq.device)
    s = s.masked_fill(torch.arange(bs_cols, device=q_seq.device)[None, :] > pos[:, None], float("-inf"))
    return torch.softmax(s, -1)


def estimate(q: torch.Tensor, k: torch.Tensor, layout: Layout, cfg, scale: float | None = None):
    """Reference of ``estimate.select_blocks``: bool ``sel`` [n_slots, Hkv, max_kblocks].

    ``cfg`` is a ``SparseConfig``. See ``SparseConfig`` for what each knob does."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    bs = layout.block_size
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sel = torch.zeros(layout.n_slots, hkv, layout.max_kblocks, dtype=torch.bool, device=q.device)
    for q0, q_len, k0, k_len, slot0, _ in _seq_ranges(layout):
        nqb, nkb = -(-q_len // bs), -(-k_len // bs)
        off = k_len - q_len
        qblk = torch.arange(nqb, device=q.device)
        a = off + qblk * bs
        lo = a // bs  # [nqb]
        hi = (torch.clamp(a + bs, max=k_len) - 1) // bs
        col = torch.arange(nkb, device=q.device)
        selectable = col[None, :] < lo[:, None]  # [nqb, nkb]
        if k_len < cfg.dense_len_threshold:
            sel[slot0:slot0 + nqb, :, :nkb] = selectable[:, None, :]
            continue
        kbar = pool_keys(k[k0:k0 + k_len], bs)  # [nkb, Hkv, D]
        qp, valid = pool_queries(q[q0:q0 + q_len], bs, cfg.q_pool, hkv)  # [nqb,Hkv,R,D], [nqb,R]
        s = torch.einsum("bhrd,chd->bhrc", qp.float(), kbar.float()) * scale  # [nqb, Hkv, R, nkb]
        cand = col[None, :] <= hi[:, None]  # [nqb, nkb]
        s = s.masked_fill(~cand[:, None, None, :], float("-inf"))
        p = torch.softmax(s, -1)
        vr = valid[:, None, :, None].float()
        gsc = (p * vr).sum(2) / vr.sum(2)  # [nqb, Hkv, nkb]
        gmax = (p.amax(-1, keepdim=True) * vr).sum(2) / vr.sum(2)  # mean of the rows' maxima
        keep = gsc >= cfg.threshold * gmax
        keep |= (col < cfg.sink_blocks)[None, None, :]
        keep |= (col[None, :] >= (lo[:, None] - cfg.local_blocks))[:, None, :]
        keep |= (qblk >= nqb - cfg.last_q_blocks)[:, None, None]
        if cfg.probe_queries > 0:
            pr = probe_scores(q[q0:q0 + q_len], k[k0:k0 + k_len], cfg.probe_queries, scale)
            pad = nkb * bs - k_len
            mass = torch.nn.functional.pad(pr, (0, pad)).view(*pr.shape[:3], nkb, bs).sum(-1)
            vert = mass.mean(2).amax(1) >= cfg.probe_threshold  # [Hkv, nkb]
            keep |= vert[None]
        sel[slot0:slot0 + nqb, :, :nkb] = keep & selectable[:, None, :]
    return sel


def density(sel: torch.Tensor, layout: Layout) -> float:
    """Fraction of causal key blocks computed (selected + diagonal region) over all causal blocks."""
    lo, hi, valid = slot_geometry(layout)
    col = torch.arange(sel.shape[-1], device=sel.device)
    picked = (sel & (col[None, None, :] < lo[:, None, None]) & valid[:, None, None]).sum()
    diag = torch.where(valid, hi - lo + 1, torch.zeros_like(hi)).sum() * sel.shape[1]
    total = torch.where(valid, hi + 1, torch.zeros_like(hi)).sum() * sel.shape[1]
    return float((picked + diag) / total)

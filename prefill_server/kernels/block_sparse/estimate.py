"""Block estimator on the GPU (Triton): which key blocks each (query block, KV head) keeps.

Three launches and a few element-wise torch ops, no host sync, no sort:
1. ``_pool_kernel`` x2: mean-pooled keys per key block (kbar) and mean-pooled queries per
   ``q_pool`` tokens of each query block, all heads of a KV group stacked as rows (qp).
2. ``_probe_kernel``: the last ``probe_queries`` queries of each sequence, exactly, against every key
   block: per-block log-sum-exp; torch turns it into each block's share of their attention mass.
   Blocks holding >= ``probe_threshold`` of some head's mass are kept for every query block
   ("vertical" columns that pooling dilutes).
3. ``_select_kernel``: per (query block, KV head), two passes over the pooled keys. Group score of key
   block c = mean over the group's pooled query rows r of p_rc = softmax_c(qp_r . kbar_c); keep c if
   score >= threshold * (mean over r of max_c p_rc), i.e. relative to the rows' maxima (pass 1 gives
   each row's max and normaliser, pass 2 thresholds). Also kept: sink / local / vertical blocks, and
   every block of dense query blocks (last ``last_q_blocks`` of a sequence, or a sequence shorter than
   ``dense_len_threshold``). Kept indices are written in ascending order with a running prefix sum
   (no sort). ``reference.estimate`` is the plain-torch definition.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _pool_kernel(X, OUT, SLOT_SEQ, SLOT_BLK, CU, stride_xt, stride_xh, stride_os, stride_oh, stride_or,
                 G: tl.constexpr, BS: tl.constexpr, P: tl.constexpr, NPP: tl.constexpr, D: tl.constexpr):
    """OUT[slot, h, g*NP + p, :] = mean of X rows [blk*BS + p*P, +P) of the slot's sequence, head h*G+g.
    The pooling is a matrix product with a 0/1 indicator [NPP, BS] (NPP >= 16 rows, NP = BS // P used)."""
    NP: tl.constexpr = BS // P
    slot = tl.program_id(0)
    h = tl.program_id(1)
    seq_raw = tl.load(SLOT_SEQ + slot)
    seq = tl.maximum(seq_raw, 0)
    blk = tl.load(SLOT_BLK + slot)
    start = tl.load(CU + seq)
    n = tl.load(CU + seq + 1) - start
    n = tl.where(seq_raw >= 0, n, 0)
    t = blk * BS + tl.arange(0, BS)
    ok = t < n
    dd = tl.arange(0, D)
    pr = tl.arange(0, NPP)
    cnt = tl.minimum(tl.maximum(n - (blk * BS + pr * P), 0), P).to(tl.float32)
    inv = 1.0 / tl.maximum(cnt, 1.0)
    ind = ((tl.arange(0, BS)[None, :] // P) == pr[:, None]).to(X.dtype.element_ty)  # [NPP, BS]
    for g in tl.static_range(G):
        ptr = X + (start + t).to(tl.int64)[:, None] * stride_xt + (h * G + g) * stride_xh + dd[None, :]
        x = tl.load(ptr, mask=ok[:, None], other=0.0)
        xs = tl.dot(ind, x) * inv[:, None]  # [NPP, D] fp32 sums -> means
        optr = OUT + slot.to(tl.int64) * stride_os + h * stride_oh + (g * NP + pr)[:, None] * stride_or + dd[None, :]
        tl.store(optr, xs.to(OUT.dtype.element_ty), mask=(pr < NP)[:, None])


@triton.jit
def _probe_kernel(Q, K, BLSE, CU_Q, CU_K, KSLOT_SEQ, KSLOT_BLK, qk_scale,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_bs, stride_bh,
                  G: tl.constexpr, BS: tl.constexpr, NPR: tl.constexpr, D: tl.constexpr):
    """BLSE[kslot, h, r] = log-sum-exp (natural) of probe query r of head h over key block kslot."""
    kslot = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_raw = tl.load(KSLOT_SEQ + kslot)
    seq = tl.maximum(seq_raw, 0)
    kb = tl.load(KSLOT_BLK + kslot)
    q_start = tl.load(CU_Q + seq)
    q_len = tl.load(CU_Q + seq + 1) - q_start
    k_start = tl.load(CU_K + seq)
    k_len = tl.load(CU_K + seq + 1) - k_start
    k_len = tl.where(seq_raw >= 0, k_len, 0)
    dd = tl.arange(0, D)
    r = tl.arange(0, NPR)
    qi = q_len - NPR + r
    r_ok = qi >= 0
    pos = k_len - NPR + r
    kt = kb * BS + tl.arange(0, BS)
    k_ok = kt < k_len
    k = tl.load(K + (k_start + kt).to(tl.int64)[:, None] * stride_kt + kvh * stride_kh + dd[None, :],
                mask=k_ok[:, None], other=0.0)
    for g in tl.static_range(G):
        h = kvh * G + g
        q = tl.load(Q + (q_start + qi).to(tl.int64)[:, None] * stride_qt + h * stride_qh + dd[None, :],
                    mask=r_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        ok = (kt[None, :] <= pos[:, None]) & k_ok[None, :] & r_ok[:, None]
        s = tl.where(ok, s, float("-inf"))
        m = tl.max(s, 1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        se = tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        lse = tl.where(se > 0.0, (m_safe + tl.log2(tl.maximum(se, 1e-30))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(BLSE + kslot.to(tl.int64) * stride_bs + h * stride_bh + r, lse)


@triton.jit
def _select_kernel(QP, KBAR, VERT, IDX, CNT, CU_Q, CU_K, SLOT_SEQ, SLOT_QBLK, KB_START,
                   qk_scale, threshold, sink_blocks, local_blocks, last_q_blocks, dense_len,
                   stride_qps, stride_qph, stride_kbs, stride_kbh, stride_vs, stride_is, stride_ih,
                   stride_cs, R: tl.constexpr, RP: tl.constexpr, NP: tl.constexpr, BS: tl.constexpr,
                   BC: tl.constexpr, D: tl.constexpr, HAS_VERT: tl.constexpr):
    slot = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_raw = tl.load(SLOT_SEQ + slot)
    live = seq_raw >= 0
    seq = tl.maximum(seq_raw, 0)
    qblk = tl.load(SLOT_QBLK + slot)
    q_len = tl.load(CU_Q + seq + 1) - tl.load(CU_Q + seq)
    k_len = tl.load(CU_K + seq + 1) - tl.load(CU_K + seq)
    kb0 = tl.load(KB_START + seq)
    a = k_len - q_len + qblk * BS
    diag_lo = tl.where(live, a // BS, 0)
    n_all = (tl.minimum(a + BS, k_len) - 1) // BS + 1
    nqb = (q_len + BS - 1) // BS
    dense = (qblk >= nqb - last_q_blocks) | (k_len < dense_len)
    n_est = tl.where(dense | (diag_lo == 0), 0, n_all)  # blocks scored (0: nothing to estimate)

    rr = tl.arange(0, RP)
    cnt_p = tl.minimum(tl.maximum(q_len - (qblk * BS + (rr % NP) * (BS // NP)), 0), BS // NP)
    r_ok = (rr < R) & (cnt_p > 0)
    w = r_ok.to(tl.float32) / tl.maximum(tl.sum(r_ok.to(tl.float32), 0), 1.0)
    dd = tl.arange(0, D)
    qp = tl.load(QP + slot.to(tl.int64) * stride_qps + kvh * stride_qph + rr[:, None] * D + dd[None, :],
                 mask=r_ok[:, None], other=0.0)
    cc = tl.arange(0, BC)
    kbase = KBAR + kb0.to(tl.int64) * stride_kbs + kvh * stride_kbh

    # pass 1: per-row max and sum of exp over all causal key blocks
    m_r = tl.full([RP], float("-inf"), tl.float32)
    l_r = tl.zeros([RP], tl.float32)
    for c0 in range(0, n_est, BC):
        c = c0 + cc
        kb = tl.load(kbase + c[:, None] * stride_kbs + dd[None, :], mask=(c < n_est)[:, None], other=0.0)
        s = tl.dot(qp, tl.trans(kb)) * qk_scale
        s = tl.where((c < n_est)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_r, tl.max(s, 1))
        l_r = l_r * tl.exp2(m_r - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_r = m_new
    wl = w / tl.where(l_r > 0, l_r, 1.0)
    m_r = tl.where(m_r == float("-inf"), 0.0, m_r)
    # the group's reference: mean over rows of each row's largest probability (1 / l_r)
    gmax = tl.sum(wl, 0)
    # pass 2: keep and write ascending indices of the selectable blocks [0, diag_lo)
    cut = threshold * gmax
    n_sel = tl.where(n_est > 0, diag_lo, 0)
    n_out = 0
    for c0 in range(0, diag_lo, BC):
        c = c0 + cc
        keep = (c < sink_blocks) | (c >= diag_lo - local_blocks) | dense
        if HAS_VERT:
            vert = tl.load(VERT + (kb0 + c).to(tl.int64) * stride_vs + kvh, mask=c < diag_lo, other=0)
            keep = keep | (vert != 0)
        if c0 < n_sel:
            kb = tl.load(kbase + c[:, None] * stride_kbs + dd[None, :], mask=(c < n_sel)[:, None], other=0.0)
            s = tl.dot(qp, tl.trans(kb)) * qk_scale
            s = tl.where((c < n_sel)[None, :], s, float("-inf"))
            gsc = tl.sum(tl.exp2(s - m_r[:, None]) * wl[:, None], 0)
            keep = keep | (gsc >= cut)
        keep = keep & (c < diag_lo)
        ki = keep.to(tl.int32)
        pos = n_out + tl.cumsum(ki, 0) - 1
        tl.store(IDX + slot.to(tl.int64) * stride_is + kvh * stride_ih + pos, c, mask=keep)
        n_out += tl.sum(ki, 0)
    tl.store(CNT + slot * stride_cs + kvh, n_out)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def pool_keys(k: torch.Tensor, layout) -> torch.Tensor:
    """kbar [n_kslots, Hkv, D] in k.dtype: mean of each key block (rows of unused kslots are junk)."""
    hkv, d = k.shape[1], k.shape[2]
    bs = layout.block_size
    kbar = torch.empty(layout.n_kslots, hkv, 1, d, dtype=k.dtype, device=k.device)
    _pool_kernel[(layout.n_kslots, hkv)](k, kbar, layout.kslot_seq, layout.kslot_kblk, layout.cu_k,
                                         k.stride(0), k.stride(1), kbar.stride(0), kbar.stride(1),
                                         kbar.stride(2), G=1, BS=bs, P=bs, NPP=16, D=d, num_warps=4)
    return kbar.view(layout.n_kslots, hkv, d)


def pool_queries(q: torch.Tensor, hkv: int, layout, q_pool: int) -> torch.Tensor:
    """qp [n_slots, Hkv, RP, D] in q.dtype; row g*NP + p pools tokens [p*q_pool, +q_pool) of head
    kvh*G + g. Rows >= G*NP are padding (never read)."""
    hq, d = q.shape[1], q.shape[2]
    g = hq // hkv
    bs = layout.block_size
    npool = bs // q_pool
    rp = max(16, _pow2(g * npool))
    qp = torch.empty(layout.n_slots, hkv, rp, d, dtype=q.dtype, device=q.device)
    _pool_kernel[(layout.n_slots, hkv)](q, qp, layout.slot_seq, layout.slot_qblk, layout.cu_q,
                                        q.stride(0), q.stride(1), qp.stride(0), qp.stride(1),
                                        qp.stride(2), G=g, BS=bs, P=q_pool, NPP=max(16, npool), D=d,
                                        num_warps=4)
    return qp


def probe(q: torch.Tensor, k: torch.Tensor, layout, n_probe: int, threshold: float, scale: float):
    """vert uint8 [n_kslots, Hkv]: 1 where some head of the group gives the key block >= threshold of
    its probe queries' mean attention mass."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    g = hq // hkv
    bs = layout.block_size
    blse = torch.empty(layout.n_kslots, hq, n_probe, dtype=torch.float32, device=q.device)
    _probe_kernel[(layout.n_kslots, hkv)](q, k, blse, layout.cu_q, layout.cu_k, layout.kslot_seq,
                                          layout.kslot_kblk, scale * LOG2E, q.stride(0), q.stride(1),
                                          k.stride(0), k.stride(1), blse.stride(0), blse.stride(1),
                                          G=g, BS=bs, NPR=n_probe, D=d, num_warps=4)
    b = layout.batch
    q_len = (layout.cu_q[1:] - layout.cu_q[:-1]).float()
    if b == 1:  # one sequence: plain reductions (unused kslots hold -inf and drop out)
        lse = torch.logsumexp(blse, 0)
        mass = torch.exp(blse - lse).nan_to_num_(0.0)
        share = mass.sum(-1) / q_len.clamp(min=1, max=n_probe)
        return (share.view(-1, hkv, g).amax(-1) >= threshold).to(torch.uint8)
    seq = layout.kslot_seq.long()
    seq = torch.where(seq >= 0, seq, torch.full_like(seq, b))  # unused kslots -> bucket b
    mx = torch.full((b + 1, hq, n_probe), float("-inf"), device=q.device)
    mx.scatter_reduce_(0, seq[:, None, None].expand_as(blse), blse, "amax")
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    se = torch.zeros_like(mx).index_add_(0, seq, torch.exp(blse - mx[seq]))
    lse = mx + torch.log(se)
    mass = torch.exp(blse - lse[seq]).nan_to_num_(0.0)  # [n_kslots, Hq, NPR]
    n_valid = torch.cat([q_len.clamp(max=n_probe), q_len.new_ones(1)]).clamp(min=1)
    share = mass.sum(-1) / n_valid[seq][:, None]  # [n_kslots, Hq]
    return (share.view(-1, hkv, g).amax(-1) >= threshold).to(torch.uint8)


def select_blocks(q: torch.Tensor, k: torch.Tensor, layout, cfg, scale: float | None = None):
    """Estimator: (idx int32 [n_slots, Hkv, max_kblocks], cnt int32 [n_slots, Hkv])."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    g = hq // hkv
    bs = layout.block_size
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kbar = pool_keys(k, layout)
    qp = pool_queries(q, hkv, layout, cfg.q_pool)
    has_vert = cfg.probe_queries > 0
    if has_vert:
        vert = probe(q, k, layout, cfg.probe_queries, cfg.probe_threshold, scale)
    else:
        vert = torch.zeros(1, 1, dtype=torch.uint8, device=q.device)
    idx = torch.empty(layout.n_slots, hkv, layout.max_kblocks, dtype=torch.int32, device=q.device)
    cnt = torch.empty(layout.n_slots, hkv, dtype=torch.int32, device=q.device)
    npool = bs // cfg.q_pool
    _select_kernel[(layout.n_slots, hkv)](
        qp, kbar, vert, idx, cnt, layout.cu_q, layout.cu_k, layout.slot_seq, layout.slot_qblk,
        layout.kb_start, scale * LOG2E, float(cfg.threshold), cfg.sink_blocks, cfg.local_blocks,
        cfg.last_q_blocks, cfg.dense_len_threshold, qp.stride(0), qp.stride(1), kbar.stride(0),
        kbar.stride(1), vert.stride(0), idx.stride(0), idx.stride(1), cnt.stride(0),
        R=g * npool, RP=qp.shape[2], NP=npool, BS=bs, BC=64, D=d, HAS_VERT=has_vert, num_warps=4)
    return idx, cnt

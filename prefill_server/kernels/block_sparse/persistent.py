"""The ``persistent`` launch scheme of ``kernel.attention``: one program per SM walks its items'
iterations as ONE flat loop, so the next item's K/V loads are in flight while the current item
finishes (no pipeline drain/fill per item). Per-item iteration counts and per-program totals come
from a few torch ops on the device (``schedule``: no host sync). Measured slower than the grid
scheme (docs/kernels-notes.md, call 3: per-iteration bookkeeping); kept as a tested alternative.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefill_server.kernels.block_sparse.tiles import BIG, _item, _store, _update


@triton.jit
def _attn_fwd_persistent(Q, K, V, O, LSE, CU_Q, CU_K, SLOT_SEQ, SLOT_QBLK, IDX, CNT, N_IT, TOT,
                         n_slots, n_items, qk_scale,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                         stride_oh, stride_lt, stride_is, stride_ih, stride_cs,
                         G: tl.constexpr, GP: tl.constexpr, TOK: tl.constexpr, BS: tl.constexpr,
                         BN: tl.constexpr, D: tl.constexpr, DENSE: tl.constexpr):
    NSUB: tl.constexpr = BS // BN
    M: tl.constexpr = TOK * GP
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tot = tl.load(TOT + pid)
    rows = tl.arange(0, M)
    dd = tl.arange(0, D)
    cols = tl.arange(0, BN)
    item = pid
    local = pid * 0
    n_cur = tl.load(N_IT + tl.minimum(item, n_items - 1))
    q = tl.zeros([M, D], dtype=Q.dtype.element_ty)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    for _ in range(0, tot):
        adv = local >= n_cur
        item = tl.where(adv, item + nprog, item)
        local = tl.where(adv, 0, local)
        n_nxt = tl.load(N_IT + tl.minimum(item, n_items - 1))
        n_cur = tl.where(adv, n_nxt, n_cur)
        slot, kvh, h0, q_start, q_len, k_start, tok0, off, diag_lo, q_last, live = _item(
            item, n_slots, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, G, GP, TOK, BS)
        tok = tok0 + rows // GP
        head = h0 + rows % GP
        row_ok = tok < q_len
        q_pos = off + tok
        if DENSE:
            n_off = diag_lo * NSUB
        else:
            n_off = tl.load(CNT + slot * stride_cs + kvh) * NSUB
        n_off = tl.where(live, n_off, 0)
        first = local == 0
        if first:
            q = tl.load(Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
                        + dd[None, :], mask=row_ok[:, None], other=0.0)
        is_diag = local >= n_off
        if DENSE:
            kb = local // NSUB
        else:
            kb = tl.load(IDX + slot.to(tl.int64) * stride_is + kvh * stride_ih + local // NSUB,
                         mask=local < n_off, other=0)
        n0 = tl.where(is_diag, diag_lo * BS + (local - n_off) * BN, kb * BS + (local % NSUB) * BN)
        kt = n0 + cols
        kmask = kt <= tl.where(is_diag, q_last, BIG)
        kbase = K + k_start.to(tl.int64) * stride_kt + kvh * stride_kh
        vbase = V + k_start.to(tl.int64) * stride_vt + kvh * stride_vh
        k = tl.load(kbase + kt.to(tl.int64)[:, None] * stride_kt + dd[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(vbase + kt.to(tl.int64)[:, None] * stride_vt + dd[None, :], mask=kmask[:, None], other=0.0)
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        s_ok = (kt[None, :] <= (q_pos + tl.where(is_diag, 0, BIG))[:, None]) & live
        m_i, l_i, acc = _update(q, k, v, s_ok, m_i, l_i, acc, qk_scale, True, False)
        if local == n_cur - 1:
            _store(O, LSE, acc, m_i, l_i, q_start, tok, head, row_ok, stride_ot, stride_oh, stride_lt, D)
        local += 1


def schedule(layout, cnt, dense: bool, hkv: int, g: int, gp: int, tok: int, bn: int, nprog: int):
    """Per-item iteration counts (item order of ``_item``) and per-program totals for the persistent
    kernel; device tensors, no host sync. Idle items get one (masked) iteration."""
    bs = layout.block_size
    split, nsub = bs // tok, bs // bn
    dev = layout.device
    slots = torch.arange(layout.n_slots - 1, -1, -1, device=dev)  # heavy first
    seq_raw = layout.slot_seq[slots].long()
    seq = seq_raw.clamp(min=0)
    q_len = (layout.cu_q[1:] - layout.cu_q[:-1])[seq].long()
    k_len = (layout.cu_k[1:] - layout.cu_k[:-1])[seq].long()
    q_len = torch.where(seq_raw >= 0, q_len, 0)
    qblk = layout.slot_qblk[slots].long()
    off = k_len - q_len
    diag_lo = (off + qblk * bs) // bs  # [S]
    tok0 = qblk[:, None] * bs + torch.arange(split, device=dev)[None, :] * tok  # [S, split]
    live = (seq_raw[:, None] >= 0) & (tok0 < q_len[:, None])
    q_last = off[:, None] + torch.minimum(tok0 + tok, q_len[:, None]) - 1
    n_diag = (q_last - diag_lo[:, None] * bs) // bn + 1  # [S, split]
    if dense:
        n_off = (diag_lo * nsub)[None, :].expand(hkv, -1)
    else:
        n_off = cnt[slots].long().T * nsub  # [Hkv, S]
    n_it = n_off[:, None, :, None] + n_diag[None, None]  # [Hkv, G/GP, S, split]
    n_it = n_it.expand(hkv, g // gp, -1, -1)
    n_it = torch.where(live[None, None], n_it, 1).reshape(-1).to(torch.int32)
    n_items = n_it.numel()
    pad = (-n_items) % nprog
    tot = torch.nn.functional.pad(n_it, (0, pad)).view(-1, nprog).sum(0, dtype=torch.int32)
    return n_it, tot

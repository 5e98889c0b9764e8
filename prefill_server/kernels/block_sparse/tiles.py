"""The Triton pieces both launch schemes of ``kernel.attention`` build on: a work item's decoding,
one key tile's online and fixed-reference softmax update, and the epilogue's store."""
from __future__ import annotations

import triton
import triton.language as tl

BIG = tl.constexpr(1 << 30)


@triton.jit
def _item(item, n_slots, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, G: tl.constexpr, GP: tl.constexpr,
          TOK: tl.constexpr, BS: tl.constexpr):
    """Decode a work item: heavy (last) query blocks first, then sub-tiles, then KV heads."""
    SPLIT: tl.constexpr = BS // TOK
    n0 = n_slots * SPLIT
    pid0 = item % n0
    pid1 = item // n0
    slot = n_slots - 1 - pid0 // SPLIT
    sub = pid0 % SPLIT
    kvh = pid1 // (G // GP)
    h0 = kvh * G + (pid1 % (G // GP)) * GP
    seq_raw = tl.load(SLOT_SEQ + slot)
    seq = tl.maximum(seq_raw, 0)
    qblk = tl.load(SLOT_QBLK + slot)
    q_start = tl.load(CU_Q + seq)
    q_len = tl.load(CU_Q + seq + 1) - q_start
    k_start = tl.load(CU_K + seq)
    k_len = tl.load(CU_K + seq + 1) - k_start
    tok0 = qblk * BS + sub * TOK
    live = (seq_raw >= 0) & (tok0 < q_len)
    q_len = tl.where(seq_raw >= 0, q_len, 0)
    off = k_len - q_len
    diag_lo = (off + qblk * BS) // BS
    q_last = tl.where(live, off + tl.minimum(tok0 + TOK, q_len) - 1, diag_lo * BS - 1)
    return slot, kvh, h0, q_start, q_len, k_start, tok0, off, diag_lo, q_last, live


@triton.jit
def _update(q, k, v, s_ok, m_i, l_i, acc, qk_scale, MASK: tl.constexpr, FMA: tl.constexpr):
    """One key tile, online softmax: the running max m_i (log2 units) moves, acc and l_i rescale."""
    s = tl.dot(q, tl.trans(k))
    if MASK:
        s = tl.where(s_ok, s, float("-inf"))
    if FMA:  # m in scaled units; s * scale - m is one FMA per score (the scale > 0 commutes with max)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    else:
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _update_fixed(q, k, v, m_i, l_i, acc, qk_scale):
    """One key tile against a FIXED reference m_i (log2 units): no row max, no rescale. Exact while
    every exp2(s - m_i) stays finite in p's dtype; the caller checks l_i afterwards (p <= l_i)."""
    s = tl.dot(q, tl.trans(k))
    p = tl.exp2(s * qk_scale - m_i[:, None])
    l_i = l_i + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return l_i, acc


@triton.jit
def _store(O, LSE, acc, m_i, l_i, q_start, tok, head, row_ok, stride_ot, stride_oh, stride_lt,
           D: tl.constexpr, RCP: tl.constexpr = False):
    dd = tl.arange(0, D)
    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # only rows of idle items, never stored
    if RCP:  # one division per row, then a multiply per element (acc / l is a ~4-instruction
        out = acc * (1.0 / l_i)[:, None]  # full-range division per element: ~270 SASS instructions)
    else:
        out = acc / l_i[:, None]
    o_ptrs = O + (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dd[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + (q_start + tok).to(tl.int64) * stride_lt + head, lse, mask=row_ok)

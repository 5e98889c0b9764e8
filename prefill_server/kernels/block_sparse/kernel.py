"""Triton block-sparse causal attention (forward), GQA-packed, variable length, q_len <= k_len.

Work item: TOK query tokens x GP query heads of one KV head's group (M = TOK * GP rows; row r is
token r // GP, head r % GP), so each K/V tile loaded serves GP heads at once. An item walks the key
blocks listed for its query block (``idx[slot, kvh, :cnt[slot, kvh]]``, ascending, all wholly before
the block's first query: no mask), then the diagonal region with the causal mask. Online softmax in
base 2; writes out (v.dtype) and LSE (float32, natural log) [Tq, Hq]. Options of the grid scheme's
off-diagonal loop: ``FMA`` (running max kept in scaled units, so ``s * scale - m`` is one FMA),
``KVLOAD`` (0: per-element pointers, 1: scalar tile base + invariant offsets, 2: TMA descriptors);
of its epilogue: ``RCP`` (one reciprocal per row instead of a division per element); ``FIXM``: 1,
the diagonal tiles first, then the off-diagonal tiles against their row max held fixed (no max, no
rescale per step), checked afterwards and redone online where a p grew past ``FIXM_LIMIT``; 2, the
same with the reference taken from one diagonal tile (the first holding one of the item's queries),
so the rest of the diagonal region runs fixed too.
Measured on the H200 and dropped (docs/kernels-notes.md, calls 7-9; code in commits 1adbf54 and
6d804b4): item scalars in one round trip, the diagonal tiles in the TMA loop, an L2 prefetch of a
later item's queries, BN=32 with 3 stages, a lazy (thresholded) rescale of the running max, and the
row sum on the tensor cores.

Two launch schemes compute the same thing:
- ``grid``: one program per item (``MERGED`` folds the diagonal tiles into the same pipelined loop);
- ``persistent`` (``persistent.py``): one program per SM walks its items' iterations as one flat loop.

Imported lazily by ``api.py``: importing the package never needs Triton.
"""
from __future__ import annotations

import logging
import math

import torch
import triton
import triton.language as tl

from prefill_server.kernels.block_sparse.tiles import BIG, _item, _store, _update, _update_fixed

LOG2E = 1.4426950408889634
log = logging.getLogger(__name__)
last_compiled = None  # the last launch's compiled kernel (registers / spills for diagnostics)
# Launch defaults on a GPU, chosen from the H200 sweeps in docs/kernels-notes.md. ``gp``/``tok``
# (GQA packing) default to ``default_tiling``; maxnreg=128 lets two 256-thread programs share an SM;
# fma=1 folds the softmax scale into the exp2 argument's FMA; kvload=2 loads the off-diagonal K/V
# tiles with TMA (host tensor descriptors; pointer loads where K/V are not [Tk, Hkv*D]-viewable).
# Call 5, 128K, sum over 2/5/10%: 49.5 ms vs 54.0 for fma=0,kvload=0 (the previous default). rcp=1:
# the epilogue multiplies by 1 / l (calls 7-8, same runs, 128K 2/5/10%: -0.8/-0.8/-0.4% and
# -1.9/-1.0/-0.2%; 256K 10%: -2.3% and -2.9%).
# fixm: the largest p (= exp2(s - reference)) the fixed-reference loop may reach, by the dtype p is
# rounded to for p @ v: fp16 overflows at 65504; bf16 and fp32 have fp32's range, and 2**64 leaves the
# fp32 sums room for 2**20 keys of |v| < 2**40.
FIXM_LIMIT = {torch.float16: 2.0 ** 15, torch.bfloat16: 2.0 ** 64, torch.float32: 2.0 ** 64}
# fixm=1: the off-diagonal loop against the diagonal tiles' row max held fixed (call 10, same run, 128K
# 2/5/10%: 6.12/13.41/25.85 ms vs 6.54/14.77/28.10; 256K -8 to -11%; all blocks 245 vs 275 ms).
# fixm=2: the diagonal region too, past one online tile (H100, same run, 128K 1/2/5%: 3.41/5.94/13.48
# ms vs 3.55/6.18/13.85; 256K -7.3/-3.0/-2.4%). Taken for sparse masks in bf16/fp32 only: in dense
# mode (all blocks) it was +4.4% at 128K (ptxas gives its off-diagonal step 13 more instructions), and
# with fp16's p (limit 2**15) its narrower reference makes real logits fall back more often
# (docs/bench/2026-12-06-diag-fixed/README.md); those keep fixm=1.
DEFAULTS = dict(mode="grid", bn=64, num_warps=8, num_stages=2, maxnreg=128, ctas_per_sm=2, fma=1, kvload=2,
                rcp=1, fixm=2, gluon=1)
# gluon=1: sparse bf16 masks on Hopper (sm_90) go to the warp-specialised kernel (``ws_kernel.py``)
# wherever it applies (``_gluon_applies``), its flagged items redone online by ``_attn_redo``; H100,
# same runs, 128K 1 / 2%: 0.87-0.89 / 0.87-0.90x this kernel's time (docs/bench/2026-12-07-gluon-pipe/).
# A launch that names any launch option gets this Triton kernel.


@triton.jit
def _off_loop(q, m_i, l_i, acc, n_off, idx_row, kbase, vbase, K_DESC, V_DESC, k_start, kvh, qk_scale,
              stride_kt, stride_vt, BS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
              DENSE: tl.constexpr, FMA: tl.constexpr, KVLOAD: tl.constexpr, WS: tl.constexpr,
              FIXED: tl.constexpr):
    """The listed key blocks wholly before the item's first query (no mask), BN keys a step."""
    NSUB: tl.constexpr = BS // BN
    cols = tl.arange(0, BN)
    dd = tl.arange(0, D)
    koffs = cols[:, None] * stride_kt + dd[None, :]  # KVLOAD 1: loop-invariant int32 offsets
    voffs = cols[:, None] * stride_vt + dd[None, :]
    for it in tl.range(0, n_off, warp_specialize=WS):
        if DENSE:
            kb = it // NSUB
        else:
            kb = tl.load(idx_row + it // NSUB)
        row0 = kb * BS + (it % NSUB) * BN  # first key of the tile, relative to the sequence
        if KVLOAD == 2:  # TMA: one bulk tensor copy per tile (2-D descriptors [Tk, Hkv * D])
            k = K_DESC.load([k_start + row0, kvh * D])
            v = V_DESC.load([k_start + row0, kvh * D])
        elif KVLOAD == 1:  # scalar tile base + invariant offsets: one 64-bit add per pointer
            k = tl.load(kbase + row0.to(tl.int64) * stride_kt + koffs)
            v = tl.load(vbase + row0.to(tl.int64) * stride_vt + voffs)
        else:
            kt = (row0 + cols).to(tl.int64)
            k = tl.load(kbase + kt[:, None] * stride_kt + dd[None, :])
            v = tl.load(vbase + kt[:, None] * stride_vt + dd[None, :])
        if FIXED:
            l_i, acc = _update_fixed(q, k, v, m_i, l_i, acc, qk_scale)
        else:
            m_i, l_i, acc = _update(q, k, v, None, m_i, l_i, acc, qk_scale, False, FMA)
    return m_i, l_i, acc


@triton.jit
def _diag_fixed(q, diag_lo, tok0, off, q_last, q_pos, live, kbase, vbase, K_DESC, V_DESC, k_start, kvh, qk_scale,
                stride_kt, stride_vt, M: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                KVLOAD: tl.constexpr):
    """The diagonal region with one row max: the first tile that reaches past the item's first query
    (every row sees that query's key there, so each row max is finite) sets the reference; the
    region's later masked tiles and its earlier tiles (wholly before every row's query: no mask, TMA
    where the off-diagonal loop uses it) run against it held fixed. Both loops run 0-2 times: not
    pipelined (no shared buffers of their own, no prologue)."""
    cols = tl.arange(0, BN)
    dd = tl.arange(0, D)
    base = diag_lo * BS
    fm = tl.where(live, (off + tok0 - base) // BN, 0)  # the first masked tile (idle items: none at all)
    n_first = base + fm * BN
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    for n0 in tl.range(n_first, q_last + 1, BN, num_stages=1):  # 1 tile, 2 where queries cross an edge
        kt = n0 + cols
        kmask = kt <= q_last
        k = tl.load(kbase + kt.to(tl.int64)[:, None] * stride_kt + dd[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(vbase + kt.to(tl.int64)[:, None] * stride_vt + dd[None, :], mask=kmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(kt[None, :] <= q_pos[:, None], s, float("-inf"))
        if n0 == n_first:  # the reference (starting from l = 0, acc = 0: no rescale to do)
            m_i = tl.max(s, 1) * qk_scale
        p = tl.exp2(s * qk_scale - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc)
    for j in tl.range(0, fm, num_stages=1):
        row0 = base + j * BN
        if KVLOAD == 2:
            k = K_DESC.load([k_start + row0, kvh * D])
            v = V_DESC.load([k_start + row0, kvh * D])
        else:
            kr = (row0 + cols).to(tl.int64)
            k = tl.load(kbase + kr[:, None] * stride_kt + dd[None, :])
            v = tl.load(vbase + kr[:, None] * stride_vt + dd[None, :])
        l_i, acc = _update_fixed(q, k, v, m_i, l_i, acc, qk_scale)
    return m_i, l_i, acc


@triton.jit
def _diag_loop(q, m_i, l_i, acc, diag_lo, q_last, q_pos, kbase, vbase, qk_scale, stride_kt, stride_vt,
               BS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, FMA: tl.constexpr):
    """The diagonal region (keys from the item's first query block to its last query), masked."""
    cols = tl.arange(0, BN)
    dd = tl.arange(0, D)
    for n0 in range(diag_lo * BS, q_last + 1, BN):
        kt = n0 + cols
        kmask = kt <= q_last
        k = tl.load(kbase + kt.to(tl.int64)[:, None] * stride_kt + dd[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(vbase + kt.to(tl.int64)[:, None] * stride_vt + dd[None, :], mask=kmask[:, None], other=0.0)
        m_i, l_i, acc = _update(q, k, v, kt[None, :] <= q_pos[:, None], m_i, l_i, acc, qk_scale, True, FMA)
    return m_i, l_i, acc


@triton.jit
def _online(q, n_off, idx_row, diag_lo, q_last, q_pos, kbase, vbase, K_DESC, V_DESC, k_start, kvh, qk_scale,
            stride_kt, stride_vt, M: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
            DENSE: tl.constexpr, FMA: tl.constexpr, KVLOAD: tl.constexpr, WS: tl.constexpr):
    """An item from an empty state, online softmax throughout: off-diagonal tiles, then the diagonal."""
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    m_i, l_i, acc = _off_loop(q, m_i, l_i, acc, n_off, idx_row, kbase, vbase, K_DESC, V_DESC, k_start, kvh,
                              qk_scale, stride_kt, stride_vt, BS, BN, D, DENSE, FMA, KVLOAD, WS, False)
    return _diag_loop(q, m_i, l_i, acc, diag_lo, q_last, q_pos, kbase, vbase, qk_scale, stride_kt, stride_vt,
                      BS, BN, D, FMA)


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, CU_Q, CU_K, SLOT_SEQ, SLOT_QBLK, IDX, CNT, K_DESC, V_DESC, n_slots, qk_scale,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
              stride_lt, stride_is, stride_ih, stride_cs,
              G: tl.constexpr, GP: tl.constexpr, TOK: tl.constexpr, BS: tl.constexpr,
              BN: tl.constexpr, D: tl.constexpr, DENSE: tl.constexpr, MERGED: tl.constexpr,
              FMA: tl.constexpr, KVLOAD: tl.constexpr, WS: tl.constexpr, RCP: tl.constexpr,
              FIXM: tl.constexpr = False, LIM: tl.constexpr = 1.0):
    SPLIT: tl.constexpr = BS // TOK
    item = tl.program_id(0) + tl.program_id(1) * (n_slots * SPLIT)
    _program(item, Q, K, V, O, LSE, CU_Q, CU_K, SLOT_SEQ, SLOT_QBLK, IDX, CNT, K_DESC, V_DESC, n_slots, qk_scale,
             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
             stride_is, stride_ih, stride_cs, G, GP, TOK, BS, BN, D, DENSE, MERGED, FMA, KVLOAD, WS, RCP, FIXM, LIM)


@triton.jit
def _attn_redo(FLAGS, n_items, Q, K, V, O, LSE, CU_Q, CU_K, SLOT_SEQ, SLOT_QBLK, IDX, CNT, n_slots, qk_scale,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
               stride_lt, stride_is, stride_ih, stride_cs,
               G: tl.constexpr, GP: tl.constexpr, TOK: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
               D: tl.constexpr, RB: tl.constexpr):
    """The items flagged (nonzero) in FLAGS [n_items], each from scratch with the online softmax; RB
    flags per program, read at once (a launch over none flagged costs one load per program)."""
    base = tl.program_id(0) * RB
    offs = base + tl.arange(0, RB)
    if tl.max(tl.load(FLAGS + offs, mask=offs < n_items, other=0), 0) != 0:
        for i in range(0, RB):
            item = base + i
            if tl.load(FLAGS + item, mask=item < n_items, other=0) != 0:
                _program(item, Q, K, V, O, LSE, CU_Q, CU_K, SLOT_SEQ, SLOT_QBLK, IDX, CNT, K, V, n_slots, qk_scale,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                         stride_lt, stride_is, stride_ih, stride_cs, G, GP, TOK, BS, BN, D, False, False, True, 1,
                         False, True, 0, 1.0)


@triton.jit
def _program(item, Q, K, V, O, LSE, CU_Q, CU_K, SLOT_SEQ, SLOT_QBLK, IDX, CNT, K_DESC, V_DESC, n_slots, qk_scale,
             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
             stride_lt, stride_is, stride_ih, stride_cs,
             G: tl.constexpr, GP: tl.constexpr, TOK: tl.constexpr, BS: tl.constexpr,
             BN: tl.constexpr, D: tl.constexpr, DENSE: tl.constexpr, MERGED: tl.constexpr,
             FMA: tl.constexpr, KVLOAD: tl.constexpr, WS: tl.constexpr, RCP: tl.constexpr,
             FIXM: tl.constexpr, LIM: tl.constexpr):
    """One work item (``_attn_fwd``'s program, or one ``_attn_redo`` redoes)."""
    NSUB: tl.constexpr = BS // BN
    M: tl.constexpr = TOK * GP
    slot, kvh, h0, q_start, q_len, k_start, tok0, off, diag_lo, q_last, live = _item(
        item, n_slots, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, G, GP, TOK, BS)
    rows = tl.arange(0, M)
    tok = tok0 + rows // GP
    head = h0 + rows % GP
    row_ok = tok < q_len
    dd = tl.arange(0, D)
    cols = tl.arange(0, BN)
    q = tl.load(Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dd[None, :],
                mask=row_ok[:, None], other=0.0)
    q_pos = off + tok
    kbase = K + k_start.to(tl.int64) * stride_kt + kvh * stride_kh
    vbase = V + k_start.to(tl.int64) * stride_vt + kvh * stride_vh
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    if DENSE:
        n_off = diag_lo * NSUB
    else:
        n_off = tl.load(CNT + slot * stride_cs + kvh) * NSUB
    n_off = tl.where(live, n_off, 0)
    idx_row = IDX + slot.to(tl.int64) * stride_is + kvh * stride_ih
    n_diag = (q_last - diag_lo * BS) // BN + 1  # 0 for idle items
    if MERGED:
        for it in range(0, n_off + n_diag):
            is_diag = it >= n_off
            if DENSE:
                kb = it // NSUB
            else:
                kb = tl.load(idx_row + it // NSUB, mask=it < n_off, other=0)
            n0 = tl.where(is_diag, diag_lo * BS + (it - n_off) * BN, kb * BS + (it % NSUB) * BN)
            kt = n0 + cols
            kmask = kt <= tl.where(is_diag, q_last, BIG)
            k = tl.load(kbase + kt.to(tl.int64)[:, None] * stride_kt + dd[None, :], mask=kmask[:, None], other=0.0)
            v = tl.load(vbase + kt.to(tl.int64)[:, None] * stride_vt + dd[None, :], mask=kmask[:, None], other=0.0)
            s_ok = kt[None, :] <= (q_pos + tl.where(is_diag, 0, BIG))[:, None]
            m_i, l_i, acc = _update(q, k, v, s_ok, m_i, l_i, acc, qk_scale, True, FMA)
    elif FIXM:
        # FIXM 1: the diagonal region first, online (every live row sees its own key there, so its max
        # is finite), then the off-diagonal tiles against that max held FIXED: no row max, no rescale
        # per step. FIXM 2: one online step (the region's first tile holding one of the item's
        # queries), the rest of the region fixed too. Since every p <= l_i, l_i <= LIM (the largest
        # p that p's dtype and the fp32 sums hold safely) afterwards proves that no step overflowed;
        # otherwise (or on NaN) the item is redone online.
        if FIXM == 2:
            m_i, l_i, acc = _diag_fixed(q, diag_lo, tok0, off, q_last, q_pos, live, kbase, vbase, K_DESC, V_DESC,
                                        k_start, kvh, qk_scale, stride_kt, stride_vt, M, BS, BN, D, KVLOAD)
        else:
            m_i, l_i, acc = _diag_loop(q, m_i, l_i, acc, diag_lo, q_last, q_pos, kbase, vbase, qk_scale,
                                       stride_kt, stride_vt, BS, BN, D, FMA)
        m_i, l_i, acc = _off_loop(q, m_i, l_i, acc, n_off, idx_row, kbase, vbase, K_DESC, V_DESC, k_start, kvh,
                                  qk_scale, stride_kt, stride_vt, BS, BN, D, DENSE, FMA, KVLOAD, WS, True)
        n_bad = tl.sum(tl.where(row_ok, tl.where(l_i <= LIM, 0, 1), 0), 0)
        if n_bad > 0:
            m_i, l_i, acc = _online(q, n_off, idx_row, diag_lo, q_last, q_pos, kbase, vbase, K_DESC, V_DESC,
                                    k_start, kvh, qk_scale, stride_kt, stride_vt, M, BS, BN, D, DENSE, FMA,
                                    KVLOAD, WS)
    else:
        m_i, l_i, acc = _online(q, n_off, idx_row, diag_lo, q_last, q_pos, kbase, vbase, K_DESC, V_DESC, k_start,
                                kvh, qk_scale, stride_kt, stride_vt, M, BS, BN, D, DENSE, FMA, KVLOAD, WS)
    _store(O, LSE, acc, m_i, l_i, q_start, tok, head, row_ok, stride_ot, stride_oh, stride_lt, D, RCP)


def _attention_gluon(q, k, v, out, lse, layout, idx, cnt2, scale):
    """The warp-specialised kernel, then the items it flagged (a fixed-reference sum past the limit)
    redone online in the same stream (no host sync: a launch over the flags)."""
    ws = _gluon_module()
    flags = ws.attention(q, k, v, layout, idx, cnt2, scale * LOG2E, FIXM_LIMIT[v.dtype], out, lse)
    redo_flagged(q, k, v, out, lse, layout, idx, cnt2, scale, flags, ws.GP, ws.TOK)
    return out, lse


def redo_flagged(q, k, v, out, lse, layout, idx, cnt2, scale, flags, gp, tok, rb: int = 256):
    """Recompute the work items (``tok`` tokens x ``gp`` heads, numbered as ``tiles._item``) whose
    int32 ``flags`` are nonzero with the online softmax, into ``out`` / ``lse``."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    g = hq // hkv
    bs = layout.block_size
    n_items = layout.n_slots * (bs // tok) * hkv * (g // gp)
    if n_items == 0:
        return
    kw = dict(num_warps=8, num_stages=2) if q.is_cuda else {}
    _attn_redo[(triton.cdiv(n_items, rb),)](
        flags, n_items, q, k, v, out, lse, layout.cu_q, layout.cu_k, layout.slot_seq, layout.slot_qblk, idx, cnt2,
        layout.n_slots, scale * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), idx.stride(0), idx.stride(1), cnt2.stride(0),
        G=g, GP=gp, TOK=tok, BS=bs, BN=min(64, bs), D=d, RB=rb, **kw)


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """float8 e4m3 codes of ``x`` with one scale for the tensor (its max magnitude maps to 448, the
    largest e4m3 value): x ~= codes * scale. For ``attention``'s FP8 scores (qk_descale = scale_q *
    scale_k); the scale comes to the host (one sync)."""
    scale = float(x.abs().amax().float().clamp(min=1e-12)) / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def _tma_ok(x: torch.Tensor, bn: int) -> bool:
    """K/V [Tk, Hkv, D] viewable as a 2-D TMA tensor [Tk, Hkv * D]: heads packed, 16-byte aligned."""
    e = x.element_size()
    return (x.stride(1) == x.shape[2] and x.stride(2) == 1 and x.data_ptr() % 16 == 0
            and (x.stride(0) * e) % 16 == 0 and x.shape[0] >= 1)


_GLUON: list = []  # the ws_kernel module once imported ([None]: not importable here)


def _gluon_module():
    if not _GLUON:
        try:
            from prefill_server.kernels.block_sparse import ws_kernel
        except Exception:  # a Triton without Gluon's Hopper API (missing, or changed under the same names)
            ws_kernel = None
        _GLUON.append(ws_kernel)
    return _GLUON[0]


def _gluon_applies(q, k, v, out, layout) -> bool:
    """The warp-specialised kernel's domain: sm_90, bf16 q/k/v/out with D = 128 and heads packed
    (TMA), GQA groups of a multiple of 4 heads, 128-token blocks."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return False
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    ok = (d == 128 and layout.block_size == 128 and hq % hkv == 0 and (hq // hkv) % 4 == 0
          and all(x.dtype == torch.bfloat16 and _tma_ok(x, 128) for x in (q, k, v, out)))
    return ok and _gluon_module() is not None


def default_tiling(g: int, block_size: int) -> tuple[int, int]:
    """(heads per program, tokens per program): pack the largest power of two (<= 16) dividing the
    group size into one program of 128 rows."""
    gp = 1
    while g % (gp * 2) == 0 and gp * 2 <= 16:
        gp *= 2
    return gp, min(block_size, 128 // gp)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, idx: torch.Tensor | None,
              cnt: torch.Tensor | None, scale: float | None = None, *, dense: bool = False,
              gp: int | None = None, tok: int | None = None, bn: int | None = None,
              num_warps: int | None = None, num_stages: int | None = None, mode: str | None = None,
              maxnreg: int | None = None, ctas_per_sm: int | None = None, nprog: int | None = None,
              fma: bool | None = None, kvload: int | None = None, ws: bool | None = None,
              rcp: bool | None = None, fixm: int | None = None, sched_cache: dict | None = None, sched=None,
              out: torch.Tensor | None = None, lse: torch.Tensor | None = None, qk_descale: float = 1.0,
              gluon: bool | None = None):
    """Launch the kernel. ``idx`` int32 [n_slots, Hkv, cap] / ``cnt`` int32 [n_slots, Hkv] come from
    ``estimate.select_blocks`` or ``api.mask_to_indices``; ``dense=True`` ignores them and visits
    every causal block. ``mode``: "grid" | "merged" | "persistent" (``sched``: a ``schedule(...)``
    result, or ``sched_cache``: a dict the caller keeps per plan). Unset launch options take
    ``DEFAULTS`` on a GPU (the interpreter ignores them). ``out``/``lse`` may be given (preallocated;
    ``out`` may be strided). Returns (out [Tq, Hq, D], lse [Tq, Hq] float32). ``gluon``: the
    warp-specialised Hopper kernel where it applies (default: ``DEFAULTS``, unless a launch option is named).

    FP8 scores: ``q`` and ``k`` may be float8 codes (e4m3) whose dot products times ``qk_descale``
    (the two per-tensor scales) are the true ones; the tensor cores take them at twice the bf16 rate.
    ``p @ v`` stays in v's dtype, and ``out`` has v's dtype."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    bs = layout.block_size
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "last dim must be contiguous"
    dflt = DEFAULTS if q.is_cuda else {}
    if gluon is None:  # a launch naming any option of this kernel gets this kernel
        gluon = bool(dflt.get("gluon")) and all(x is None for x in (
            mode, gp, tok, bn, num_warps, num_stages, maxnreg, ctas_per_sm, nprog, fma, kvload, ws, rcp, fixm, sched))
    mode = mode or dflt.get("mode", "grid")
    num_warps = num_warps or dflt.get("num_warps")
    num_stages = num_stages or dflt.get("num_stages")
    maxnreg = maxnreg or dflt.get("maxnreg")
    ctas_per_sm = ctas_per_sm or dflt.get("ctas_per_sm", 1)
    fma = bool(dflt.get("fma", 0) if fma is None else fma)
    kvload = int(dflt.get("kvload", 0) if kvload is None else kvload)
    ws = bool(dflt.get("ws", 0) if ws is None else ws)
    rcp = bool(dflt.get("rcp", 0) if rcp is None else rcp)
    dgp, dtok = default_tiling(g, bs)
    if gp is None and dflt.get("gp") and g % dflt["gp"] == 0 and bs % dflt.get("tok", bs) == 0:
        gp, tok = dflt["gp"], tok or dflt.get("tok")
    gp = gp or dgp
    tok = tok or (dtok if gp == dgp else min(bs, 128 // gp))
    bn = min(bs, bn or dflt.get("bn") or (64 if d > 64 and q.dtype == torch.float32 else bs))
    assert g % gp == 0 and bs % tok == 0 and bs % bn == 0 and tok * gp >= 16, (g, gp, bs, tok)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    assert (q.dtype == k.dtype == v.dtype) or (q.dtype == k.dtype == torch.float8_e4m3fn), (q.dtype, k.dtype, v.dtype)
    out = torch.empty(q.shape, dtype=v.dtype, device=q.device) if out is None else out
    lse = torch.empty(tq, hq, dtype=torch.float32, device=q.device) if lse is None else lse
    assert out.shape == q.shape and out.stride(-1) == 1 and lse.shape == (tq, hq) and lse.stride(1) == 1
    scale = scale * qk_descale
    if dense or idx is None:
        idx = cnt = torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device)
        dense = True
    if fixm is None:
        fixm = int(dflt.get("fixm", 0))
        if fixm == 2 and (dense or v.dtype == torch.float16):
            fixm = 1  # (DEFAULTS' comment)
    cnt2 = cnt.view(cnt.shape[0], -1)
    if gluon and not dense and fixm and _gluon_applies(q, k, v, out, layout):
        try:
            return _attention_gluon(q, k, v, out, lse, layout, idx, cnt2, scale)
        except torch.cuda.OutOfMemoryError:  # the moment's memory, not the kernel: the caller's to handle
            raise
        except Exception as e:  # e.g. a Triton whose Gluon compiles it no more: this kernel from now on
            log.warning("the warp-specialised sparse kernel failed (%s: %s); using the Triton kernel from now on",
                        type(e).__name__, e)
            _GLUON[:] = [None]
    kw = {}
    if num_warps is not None:
        kw["num_warps"] = num_warps
    if num_stages is not None:
        kw["num_stages"] = num_stages
    if maxnreg is not None:
        kw["maxnreg"] = maxnreg
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               out.stride(0), out.stride(1), lse.stride(0), idx.stride(0), idx.stride(1), cnt2.stride(0))
    global last_compiled
    if mode == "persistent":
        from prefill_server.kernels.block_sparse.persistent import _attn_fwd_persistent, schedule

        if nprog is None:
            nprog = (torch.cuda.get_device_properties(q.device).multi_processor_count * ctas_per_sm
                     if q.is_cuda else 4)
        if sched is None:
            key = (dense, gp, tok, bn, nprog)
            if sched_cache is not None and key in sched_cache:
                sched = sched_cache[key]
            else:
                sched = schedule(layout, cnt2, dense, hkv, g, gp, tok, bn, nprog)
                if sched_cache is not None:
                    sched_cache[key] = sched
        n_it, tot = sched
        last_compiled = _attn_fwd_persistent[(tot.numel(),)](
            q, k, v, out, lse, layout.cu_q, layout.cu_k, layout.slot_seq, layout.slot_qblk, idx, cnt2,
            n_it, tot, layout.n_slots, n_it.numel(), scale * LOG2E, *strides,
            G=g, GP=gp, TOK=tok, BS=bs, BN=bn, D=d, DENSE=dense, **kw)
    else:
        kd, vd = k, v  # unused unless kvload == 2
        if kvload == 2:
            if _tma_ok(k, bn) and _tma_ok(v, bn):
                from triton.tools.tensor_descriptor import TensorDescriptor
                kd, vd = (TensorDescriptor(x, [x.shape[0], x.shape[1] * d], [x.stride(0), 1], [bn, d])
                          for x in (k, v))
            else:
                kvload = 1
        grid = (layout.n_slots * (bs // tok), hkv * (g // gp))
        last_compiled = _attn_fwd[grid](
            q, k, v, out, lse, layout.cu_q, layout.cu_k, layout.slot_seq, layout.slot_qblk, idx, cnt2,
            kd, vd, layout.n_slots, scale * LOG2E, *strides,
            G=g, GP=gp, TOK=tok, BS=bs, BN=bn, D=d, DENSE=dense, MERGED=(mode == "merged"),
            FMA=fma, KVLOAD=kvload, WS=ws, RCP=rcp, FIXM=fixm, LIM=FIXM_LIMIT[v.dtype], **kw)
    return out, lse

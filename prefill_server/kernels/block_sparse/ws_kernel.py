"""The sparse kernel on Hopper (sm_90), warp-specialised in Gluon: same work items, masks and outputs
as ``kernel._attn_fwd`` with ``fixm`` (32 tokens x 4 heads of one KV head's group, M = 128 rows; here
row r is head r // TOK, token r % TOK), as one persistent program per SM in three partitions:

- a loader (one warp): per item, Q (one TMA box [TOK, D] per head) into one of two Q buffers, then
  the key tiles (the diagonal region in BD-key tiles, then the listed blocks in BN-key tiles) into
  rings of K and V stages, as far ahead as the rings allow: the next item's Q and first tiles arrive
  while the current one computes;
- two compute partitions (one warpgroup each, 64 of the item's rows; they share the K/V tiles):
  the diagonal region online, then the listed tiles against its row max held fixed, software-pipelined
  inside the warpgroup (tile u's Q K^T and tile u-1's P V on the tensor cores together, tile u's
  exponentials beside P V); the output of a whole item leaves by TMA from the partition's rows of the
  item's Q buffer, so the next item starts while it drains.

A row whose fixed-reference sum passed ``LIM`` (or is NaN) flags its item in ``FLAGS``; the caller
redoes flagged items online (``kernel.redo_flagged``). Measured against the Triton kernel
(docs/bench/2026-12-07-gluon-pipe/README.md). Imported only on a GPU that runs it.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

GP, TOK, BN, BD, STAGES = 4, 32, 128, 64, 2  # item = TOK tokens x GP heads; listed / diagonal tile keys
WARPS, MAXNREG, LOADER_REGS, COMPUTE_REGS = 4, 168, 24, 216
# Registers: the CTA's pool is MAXNREG x 3 warpgroups; while the partitions start, the loader holds
# LOADER_REGS, the second compute partition COMPUTE_REGS and the default one asks for 256 (ptxas'
# setmaxnreg): past the pool that request spins for ever.
assert LOADER_REGS + COMPUTE_REGS + 256 <= 3 * MAXNREG


@gluon.jit
def _info(item, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, stride_cs, G: gl.constexpr,
          GP: gl.constexpr, TOK: gl.constexpr, BS: gl.constexpr, BN: gl.constexpr, BD: gl.constexpr):
    """An item's scalars and tile counts (as ``tiles._item``: heavy query blocks first, then token
    slices, then KV heads): diagonal tiles of BD keys (those before ``fm`` lie wholly before every
    row's query: no mask), listed tiles of BN keys; none for an idle item."""
    SPLIT: gl.constexpr = BS // TOK
    n0 = n_slots * SPLIT
    pid0 = item % n0
    pid1 = item // n0
    slot = n_slots - 1 - pid0 // SPLIT
    kvh = pid1 // (G // GP)
    h0 = kvh * G + (pid1 % (G // GP)) * GP
    seq_raw = gl.load(SLOT_SEQ + slot)
    seq = gl.maximum(seq_raw, 0)
    qblk = gl.load(SLOT_QBLK + slot)
    q_start = gl.load(CU_Q + seq)
    q_len = gl.load(CU_Q + seq + 1) - q_start
    k_start = gl.load(CU_K + seq)
    k_len = gl.load(CU_K + seq + 1) - k_start
    tok0 = qblk * BS + (pid0 % SPLIT) * TOK
    live = (seq_raw >= 0) & (tok0 < q_len)
    off = k_len - q_len
    diag_lo = (off + qblk * BS) // BS
    q_last = off + gl.minimum(tok0 + TOK, q_len) - 1
    n_off = gl.where(live, gl.load(CNT + slot * stride_cs + kvh) * (BS // BN), 0)
    n_diag = gl.where(live, (q_last - diag_lo * BS) // BD + 1, 0)
    fm = (off + tok0 - diag_lo * BS) // BD
    return slot, kvh, h0, q_start, q_len, k_start, tok0, off, diag_lo, live, n_diag, fm, n_off


@gluon.jit
def _load_kv(k_desc, v_desc, row, col, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, tc, N: gl.constexpr,
             STAGES: gl.constexpr):
    """Tile ``tc`` (N keys from ``row``) into its K and V stages once each is free."""
    st = tc % STAGES
    ph = ((tc // STAGES) & 1) ^ 1
    mbarrier.wait(k_empty.index(st), ph)
    mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(st), k_bufs.index(st).slice(0, N))
    mbarrier.wait(v_empty.index(st), ph)
    mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(st), v_bufs.index(st).slice(0, N))


@gluon.jit
def _loader(q_desc, k_desc, v_desc, kd_desc, vd_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,
            v_ready, v_empty, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, IDX, CNT, stride_is, stride_ih,
            stride_cs, G: gl.constexpr, GP: gl.constexpr, TOK: gl.constexpr, BS: gl.constexpr, BN: gl.constexpr,
            BD: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    NSUB: gl.constexpr = BS // BN
    qc = 0  # Q buffers filled (live items)
    tc = 0  # K/V tiles loaded
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        slot, kvh, h0, q_start, q_len, k_start, tok0, off, diag_lo, live, n_diag, fm, n_off = _info(
            item, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, stride_cs, G, GP, TOK, BS, BN, BD)
        if live:
            qb = qc % 2
            mbarrier.wait(q_empty.index(qb), ((qc // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qb), GP * q_desc.block_type.nbytes)
            for j in gl.static_range(GP):
                tma.async_copy_global_to_shared(q_desc, [q_start + tok0, (h0 + j) * D], q_ready.index(qb),
                                                q_bufs.index(qb).slice(j * TOK, TOK))
            qc += 1
        for t in range(0, n_diag):
            _load_kv(kd_desc, vd_desc, k_start + diag_lo * BS + t * BD, kvh * D, k_bufs, v_bufs, k_ready, k_empty,
                     v_ready, v_empty, tc, BD, STAGES)
            tc += 1
        idx_row = IDX + slot.to(gl.int64) * stride_is + kvh * stride_ih
        for u in range(0, n_off):
            row = k_start + gl.load(idx_row + u // NSUB) * BS + (u % NSUB) * BN
            _load_kv(k_desc, v_desc, row, kvh * D, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, tc, BN,
                     STAGES)
            tc += 1


@gluon.jit
def _online(sc, v_buf, m_i, l_i, acc, qk_scale, o_rows: gl.constexpr, p_layout: gl.constexpr):
    """One diagonal tile, online softmax (m in scaled log2 units: s * scale - m is one FMA)."""
    m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
    p = gl.exp2(sc * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(v_buf.dtype), p_layout), v_buf, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    return m_new, l_i, acc


@gluon.jit
def _listed(q_buf, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, tc, n, m_i, l_i, acc, s_zero, qk_scale,
            p_layout: gl.constexpr, STAGES: gl.constexpr):
    """``n`` >= 1 listed tiles against the fixed row reference ``m_i`` (no row max, no rescale of
    ``acc``), pipelined: tile u's S = Q K^T is issued with tile u-1's P V, and tile u's exponentials
    run while P V is on the tensor cores. K stages go back as soon as their S is done."""
    st = tc % STAGES
    ph = (tc // STAGES) & 1
    mbarrier.wait(k_ready.index(st), ph)
    sc = warpgroup_mma(q_buf, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(0, deps=(sc, ))
    mbarrier.arrive(k_empty.index(st))
    p = gl.exp2(sc * qk_scale - m_i[:, None])
    l_i = l_i + gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(q_buf.dtype), p_layout)
    sp = st
    pp = ph
    tc += 1
    for u in range(1, n):
        st = tc % STAGES
        ph = (tc // STAGES) & 1
        mbarrier.wait(k_ready.index(st), ph)
        mbarrier.wait(v_ready.index(sp), pp)
        sc = warpgroup_mma(q_buf, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_bufs.index(sp), acc, is_async=True)
        sc = warpgroup_mma_wait(1, deps=(sc, ))
        mbarrier.arrive(k_empty.index(st))
        p = gl.exp2(sc * qk_scale - m_i[:, None])
        l_i = l_i + gl.sum(p, 1)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(sp))
        p_op = gl.convert_layout(p.to(q_buf.dtype), p_layout)
        sp = st
        pp = ph
        tc += 1
    mbarrier.wait(v_ready.index(sp), pp)
    acc = warpgroup_mma(p_op, v_bufs.index(sp), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(sp))
    return l_i, acc, tc


@gluon.jit
def _compute(q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, O, LSE, FLAGS,
             n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, qk_scale, stride_ot, stride_oh, stride_lt,
             stride_cs, G: gl.constexpr, GP: gl.constexpr, TOK: gl.constexpr, BS: gl.constexpr, BN: gl.constexpr,
             BD: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, LIM: gl.constexpr, WG: gl.constexpr,
             WARPS: gl.constexpr):
    """Rows [WG * M, (WG + 1) * M) of each item."""
    M: gl.constexpr = TOK * GP // 2
    HW: gl.constexpr = M // TOK  # heads of this partition's rows
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BN, 16])
    sd_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, BD, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    sd_rows: gl.constexpr = gl.SliceLayout(1, sd_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    r_d = gl.arange(0, M, layout=sd_rows) + WG * M
    c_d = gl.arange(0, BD, layout=gl.SliceLayout(0, sd_layout))
    r_s = gl.arange(0, M, layout=s_rows) + WG * M
    r_o = gl.arange(0, M, layout=o_rows) + WG * M
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    s_zero = gl.zeros([M, BN], gl.float32, s_layout)
    sd_zero = gl.zeros([M, BD], gl.float32, sd_layout)
    o_zero = gl.zeros([M, D], gl.float32, o_layout)
    qc = 0
    tc = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        slot, kvh, h0, q_start, q_len, k_start, tok0, off, diag_lo, live, n_diag, fm, n_off = _info(
            item, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, stride_cs, G, GP, TOK, BS, BN, BD)
        if live:
            qb = qc % 2
            mbarrier.wait(q_ready.index(qb), (qc // 2) & 1)
            q_buf = q_bufs.index(qb).slice(WG * M, M)
            q_pos = off + tok0 + r_d % TOK
            # the diagonal region, online; its first tile (every row sees a key there, so every row max
            # is finite from it) starts the sums: no zeroed accumulator, no rescale
            st = tc % STAGES
            mbarrier.wait(k_ready.index(st), (tc // STAGES) & 1)
            mbarrier.wait(v_ready.index(st), (tc // STAGES) & 1)
            s0 = warpgroup_mma(q_buf, k_bufs.index(st).slice(0, BD).permute((1, 0)), sd_zero, use_acc=False,
                               is_async=True)
            s0 = warpgroup_mma_wait(0, deps=(s0, ))
            if fm <= 0:
                s0 = gl.where((diag_lo * BS + c_d)[None, :] <= q_pos[:, None], s0, float("-inf"))
            m_d = gl.max(s0, 1) * qk_scale
            p0 = gl.exp2(s0 * qk_scale - m_d[:, None])
            l_d = gl.sum(p0, 1)
            acc = warpgroup_mma(gl.convert_layout(p0.to(q_buf.dtype), p_layout), v_bufs.index(st).slice(0, BD),
                                o_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(k_empty.index(st))
            mbarrier.arrive(v_empty.index(st))
            tc += 1
            for t in range(1, n_diag):
                st = tc % STAGES
                mbarrier.wait(k_ready.index(st), (tc // STAGES) & 1)
                mbarrier.wait(v_ready.index(st), (tc // STAGES) & 1)
                sd = warpgroup_mma(q_buf, k_bufs.index(st).slice(0, BD).permute((1, 0)), sd_zero, use_acc=False,
                                   is_async=True)
                sd = warpgroup_mma_wait(0, deps=(sd, ))
                if t >= fm:
                    sd = gl.where((diag_lo * BS + t * BD + c_d)[None, :] <= q_pos[:, None], sd, float("-inf"))
                m_d, l_d, acc = _online(sd, v_bufs.index(st).slice(0, BD), m_d, l_d, acc, qk_scale, o_rows,
                                        p_layout)
                mbarrier.arrive(k_empty.index(st))
                mbarrier.arrive(v_empty.index(st))
                tc += 1
            m_i = gl.convert_layout(m_d, s_rows)
            l_i = gl.convert_layout(l_d, s_rows)
            if n_off > 0:
                l_i, acc, tc = _listed(q_buf, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, tc, n_off, m_i,
                                       l_i, acc, s_zero, qk_scale, p_layout, STAGES)
            # every p <= l_i, so l_i <= LIM proves no step overflowed; otherwise (or NaN) the item is redone
            bad = ~(l_i <= LIM) & (r_s % TOK + tok0 < q_len)
            gl.atomic_add(FLAGS + item + r_s * 0, bad.to(gl.int32), mask=bad, sem="relaxed")
            # epilogue: rows are (head r // TOK, token r % TOK)
            tok = tok0 + r_o % TOK
            head = h0 + r_o // TOK
            l_o = gl.convert_layout(l_i, o_rows)
            l_o = gl.where(l_o > 0.0, l_o, 1.0)
            out = (acc * (1.0 / l_o)[:, None]).to(o_desc.dtype)
            row_ok = tok < q_len
            if tok0 + TOK <= q_len:  # a whole item: by TMA through this partition's rows of the Q buffer
                q_buf.store(out)
                fence_async_shared()
                for j in gl.static_range(HW):
                    tma.async_copy_shared_to_global(o_desc, [q_start + tok0, (h0 + WG * HW + j) * D],
                                                    q_buf.slice(j * TOK, TOK))
                tma.store_wait(0)
            else:  # the sequence's last, partial item: its box would write the next sequence's rows
                o_ptrs = O + (q_start + tok).to(gl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d_o[None, :]
                gl.store(o_ptrs, out, mask=row_ok[:, None])
            lse = (gl.convert_layout(m_i, o_rows) + gl.log2(l_o)) * 0.6931471805599453
            gl.store(LSE + (q_start + tok).to(gl.int64) * stride_lt + head, lse, mask=row_ok)
            mbarrier.arrive(q_empty.index(qb))
            qc += 1


@gluon.jit
def _attn_ws(q_desc, k_desc, v_desc, kd_desc, vd_desc, o_desc, O, LSE, FLAGS, CU_Q, CU_K, SLOT_SEQ, SLOT_QBLK, IDX,
             CNT, n_slots, n_items, qk_scale, stride_ot, stride_oh, stride_lt, stride_is, stride_ih, stride_cs,
             G: gl.constexpr, GP: gl.constexpr, TOK: gl.constexpr, BS: gl.constexpr, BN: gl.constexpr,
             BD: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, LIM: gl.constexpr, LOADER_REGS: gl.constexpr,
             COMPUTE_REGS: gl.constexpr, num_warps: gl.constexpr):
    M: gl.constexpr = TOK * GP
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2, M, D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize([
        (_compute, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, O, LSE,
                    FLAGS, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, qk_scale, stride_ot, stride_oh,
                    stride_lt, stride_cs, G, GP, TOK, BS, BN, BD, D, STAGES, LIM, 0, num_warps)),
        (_compute, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc, O, LSE,
                    FLAGS, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, qk_scale, stride_ot, stride_oh,
                    stride_lt, stride_cs, G, GP, TOK, BS, BN, BD, D, STAGES, LIM, 1, num_warps)),
        (_loader, (q_desc, k_desc, v_desc, kd_desc, vd_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                   k_empty, v_ready, v_empty, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, IDX, CNT, stride_is,
                   stride_ih, stride_cs, G, GP, TOK, BS, BN, BD, D, STAGES))],
        [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])


def _desc(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """x [T, H, D] (heads packed; rows may be strided, as slices of one projection) as the 2-D TMA
    tensor [T, H * D]."""
    t, h, d = x.shape
    lay = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(x, [t, h * d], [x.stride(0), 1], block, lay)


def attention(q, k, v, layout, idx, cnt2, qk_scale_log2: float, lim: float, out, lse) -> torch.Tensor:
    """Launch over every item; returns the int32 flags [n_items] of items to redo online (nonzero).
    The caller has checked ``kernel._gluon_applies``."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    bs = layout.block_size
    n_items = layout.n_slots * (bs // TOK) * hkv * (g // GP)
    flags = torch.zeros(max(n_items, 1), dtype=torch.int32, device=q.device)
    if n_items == 0:
        return flags
    nprog = min(torch.cuda.get_device_properties(q.device).multi_processor_count, n_items)
    _attn_ws[(nprog,)](
        _desc(q, [TOK, d]), _desc(k, [BN, d]), _desc(v, [BN, d]), _desc(k, [BD, d]), _desc(v, [BD, d]),
        _desc(out, [TOK, d]), out, lse, flags, layout.cu_q, layout.cu_k, layout.slot_seq, layout.slot_qblk, idx, cnt2,
        layout.n_slots, n_items, qk_scale_log2, out.stride(0), out.stride(1), lse.stride(0), idx.stride(0),
        idx.stride(1), cnt2.stride(0),
        G=g, GP=GP, TOK=TOK, BS=bs, BN=BN, BD=BD, D=d, STAGES=STAGES, LIM=lim, LOADER_REGS=LOADER_REGS,
        COMPUTE_REGS=COMPUTE_REGS, num_warps=WARPS, maxnreg=MAXNREG)
    return flags

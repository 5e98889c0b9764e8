"""Block-sparse causal attention forward in Gluon with warp specialisation (Hopper): an experiment
against the shipped Triton kernel (``prefill_server/kernels/block_sparse/kernel.py``) at low density.

Same work items, masks and outputs as the shipped kernel (TOK query tokens x GP heads of one KV
head's group, M = TOK * GP rows; here row r is head r // TOK, token r % TOK), but one persistent
program per SM in two partitions:
- a loader (one warp, few registers): for each of the program's items, the item's Q (GP TMA boxes
  [TOK, D]) into one of two Q buffers, then its key tiles (the diagonal region first, then the listed
  blocks) by TMA into a ring of STAGES K/V buffers, as far ahead as the ring allows: the next item's
  Q and first tiles arrive while the current item computes;
- the compute partition (8 warps, the registers the loader leaves: no wgmma serialised for lack of
  registers): online softmax over the tiles (the diagonal tiles first, so every row max is finite
  from the first tile), ``p @ v`` from registers, the output and LSE stored from registers.

bf16 / fp16, D = 128. Not the engine's kernel: ``bench.py`` checks it against the reference and
times it beside the shipped kernel and cuDNN.
"""
from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634


@gluon.jit
def _decode(item, n_slots, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, G: gl.constexpr, GP: gl.constexpr,
            TOK: gl.constexpr, BS: gl.constexpr):
    """As ``tiles._item``: heavy (last) query blocks first, then sub-tiles, then KV heads."""
    SPLIT: gl.constexpr = BS // TOK
    n0 = n_slots * SPLIT
    pid0 = item % n0
    pid1 = item // n0
    slot = n_slots - 1 - pid0 // SPLIT
    sub = pid0 % SPLIT
    kvh = pid1 // (G // GP)
    h0 = kvh * G + (pid1 % (G // GP)) * GP
    seq_raw = gl.load(SLOT_SEQ + slot)
    seq = gl.maximum(seq_raw, 0)
    qblk = gl.load(SLOT_QBLK + slot)
    q_start = gl.load(CU_Q + seq)
    q_len = gl.load(CU_Q + seq + 1) - q_start
    k_start = gl.load(CU_K + seq)
    k_len = gl.load(CU_K + seq + 1) - k_start
    tok0 = qblk * BS + sub * TOK
    live = (seq_raw >= 0) & (tok0 < q_len)
    off = k_len - q_len
    diag_lo = (off + qblk * BS) // BS
    q_last = off + gl.minimum(tok0 + TOK, q_len) - 1
    return slot, kvh, h0, q_start, q_len, k_start, tok0, off, diag_lo, q_last, live


@gluon.jit
def _info(item, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, stride_cs, G: gl.constexpr,
          GP: gl.constexpr, TOK: gl.constexpr, BS: gl.constexpr, BN: gl.constexpr, BD: gl.constexpr,
          DENSE: gl.constexpr):
    """An item's scalars and tile counts: diagonal tiles of BD keys (those before ``fm`` lie wholly
    before every row's query: no mask), off-diagonal tiles of BN keys; no tiles for an idle item (or
    for ``item`` >= n_items, which a prefetch past the last item asks for)."""
    NSUB: gl.constexpr = BS // BN
    it = gl.minimum(item, n_items - 1)
    slot, kvh, h0, q_start, q_len, k_start, tok0, off, diag_lo, q_last, live = _decode(
        it, n_slots, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, G, GP, TOK, BS)
    live = live & (item < n_items)
    if DENSE:
        n_off = diag_lo * NSUB
    else:
        n_off = gl.load(CNT + slot * stride_cs + kvh) * NSUB
    n_diag = (q_last - diag_lo * BS) // BD + 1
    fm = (off + tok0 - diag_lo * BS) // BD
    n_off = gl.where(live, n_off, 0)
    n_diag = gl.where(live, n_diag, 0)
    return slot, kvh, h0, q_start, q_len, k_start, tok0, off, diag_lo, live, n_diag, fm, n_off


@gluon.jit
def _loader(q_desc, k_desc, v_desc, kd_desc, vd_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
            k_empty, v_ready, v_empty, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, IDX, CNT, stride_is, stride_ih, stride_cs,
            G: gl.constexpr, GP: gl.constexpr, TOK: gl.constexpr, BS: gl.constexpr, BN: gl.constexpr,
            BD: gl.constexpr, D: gl.constexpr, DENSE: gl.constexpr, STAGES: gl.constexpr):
    NSUB: gl.constexpr = BS // BN
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    qc = 0  # Q buffers filled so far (live items)
    tc = 0  # K/V tiles loaded so far
    for item in range(pid, n_items, nprog):
        c_slot, c_kvh, c_h0, c_q_start, c_q_len, c_k_start, c_tok0, c_off, c_diag_lo, c_live, c_n_diag, c_fm, c_n_off = _info(
            item, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, stride_cs, G, GP, TOK, BS, BN, BD, DENSE)
        if c_live:
            qb = qc % 2
            mbarrier.wait(q_empty.index(qb), ((qc // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qb), GP * q_desc.block_type.nbytes)
            for j in gl.static_range(GP):
                tma.async_copy_global_to_shared(q_desc, [c_q_start + c_tok0, (c_h0 + j) * D], q_ready.index(qb),
                                                q_bufs.index(qb).slice(j * TOK, TOK))
            qc += 1
        for t in range(0, c_n_diag):  # BD keys each, into the first BD rows of a stage
            st = tc % STAGES
            row = c_k_start + c_diag_lo * BS + t * BD
            mbarrier.wait(k_empty.index(st), ((tc // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(st), kd_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kd_desc, [row, c_kvh * D], k_ready.index(st),
                                            k_bufs.index(st).slice(0, BD))
            mbarrier.wait(v_empty.index(st), ((tc // STAGES) & 1) ^ 1)
            mbarrier.expect(v_ready.index(st), vd_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(vd_desc, [row, c_kvh * D], v_ready.index(st),
                                            v_bufs.index(st).slice(0, BD))
            tc += 1
        idx_row = IDX + c_slot.to(gl.int64) * stride_is + c_kvh * stride_ih
        for u in range(0, c_n_off):
            if DENSE:
                kb = u // NSUB
            else:
                kb = gl.load(idx_row + u // NSUB)
            row = c_k_start + kb * BS + (u % NSUB) * BN
            st = tc % STAGES
            mbarrier.wait(k_empty.index(st), ((tc // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, c_kvh * D], k_ready.index(st), k_bufs.index(st))
            mbarrier.wait(v_empty.index(st), ((tc // STAGES) & 1) ^ 1)
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, c_kvh * D], v_ready.index(st), v_bufs.index(st))
            tc += 1


@gluon.jit
def _kv(k_bufs, v_bufs, k_ready, v_ready, tc, STAGES: gl.constexpr):
    """Tile ``tc``'s stage once both its K and V have landed (the unpipelined loops)."""
    s = tc % STAGES
    mbarrier.wait(k_ready.index(s), (tc // STAGES) & 1)
    mbarrier.wait(v_ready.index(s), (tc // STAGES) & 1)
    return k_bufs.index(s), v_bufs.index(s), s


@gluon.jit
def _release(k_empty, v_empty, s):
    mbarrier.arrive(k_empty.index(s))
    mbarrier.arrive(v_empty.index(s))


@gluon.jit
def _scores(q_buf, k_buf, s_zero):
    sc = warpgroup_mma(q_buf, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma_wait(0, deps=(sc, ))


@gluon.jit
def _online(sc, v_buf, m_i, l_i, acc, qk_scale, o_rows: gl.constexpr, p_layout: gl.constexpr):
    """One key tile, online softmax (m in scaled log2 units: s * scale - m is one FMA)."""
    m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
    p = gl.exp2(sc * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(v_buf.dtype), p_layout), v_buf, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    return m_new, l_i, acc


@gluon.jit
def _take_turn(turn, gc, WG: gl.constexpr, PP: gl.constexpr):
    """Ping-pong (``PP``): the two compute partitions issue their tensor-core work in turns, so one's
    exponentials run while the other's products are on the tensor cores. Partition 0 goes first."""
    if PP:
        mbarrier.wait(turn.index(WG), (gc & 1) ^ (1 - WG))


@gluon.jit
def _pass_turn(turn, gc, WG: gl.constexpr, PP: gl.constexpr):
    if PP:
        mbarrier.arrive(turn.index(1 - WG))
    return gc + 1


@gluon.jit
def _fixed_pipelined(q_buf, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn, tc, gc, n, m_i, l_i, acc,
                     s_zero, qk_scale, p_layout: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
                     PP: gl.constexpr):
    """``n`` >= 1 listed tiles against the fixed row reference ``m_i``, software-pipelined inside the
    warpgroup: tile u's S = Q K^T and tile u-1's P V are on the tensor cores together, and tile u's
    exponentials run while P V still is (no rescale of ``acc`` in the fixed mode, so nothing waits for
    it). K and V stages are released separately: K as soon as its S is done."""
    st = tc % STAGES
    ph = (tc // STAGES) & 1
    mbarrier.wait(k_ready.index(st), ph)
    _take_turn(turn, gc, WG, PP)
    sc = warpgroup_mma(q_buf, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    gc = _pass_turn(turn, gc, WG, PP)
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
        _take_turn(turn, gc, WG, PP)
        sc = warpgroup_mma(q_buf, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_bufs.index(sp), acc, is_async=True)
        gc = _pass_turn(turn, gc, WG, PP)
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
    _take_turn(turn, gc, WG, PP)
    acc = warpgroup_mma(p_op, v_bufs.index(sp), acc, is_async=True)
    gc = _pass_turn(turn, gc, WG, PP)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(sp))
    return l_i, acc, tc, gc


@gluon.jit
def _compute(q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, O, LSE, o_desc,
             n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, BAD, qk_scale,
             stride_ot, stride_oh, stride_lt, stride_cs,
             G: gl.constexpr, GP: gl.constexpr, TOK: gl.constexpr, BS: gl.constexpr, BN: gl.constexpr,
             BD: gl.constexpr, D: gl.constexpr, DENSE: gl.constexpr, STAGES: gl.constexpr, FIXED: gl.constexpr,
             LIM: gl.constexpr, WG: gl.constexpr, NWG: gl.constexpr, WARPS: gl.constexpr,
             PEEL: gl.constexpr = True, PIPE: gl.constexpr = False, TSTORE: gl.constexpr = False,
             PP: gl.constexpr = False):
    """Rows [WG * M, (WG + 1) * M) of each item (NWG compute partitions share the K/V tiles; with
    two, one's softmax runs while the other's product is on the tensor cores)."""
    M: gl.constexpr = TOK * GP // NWG
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
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
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
    gc = 0  # tensor-core turns taken (ping-pong)
    for item in range(pid, n_items, nprog):
        c_slot, c_kvh, c_h0, c_q_start, c_q_len, c_k_start, c_tok0, c_off, c_diag_lo, c_live, c_n_diag, c_fm, c_n_off = _info(
            item, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, stride_cs, G, GP, TOK, BS, BN, BD, DENSE)
        if c_live:
            qb = qc % 2
            mbarrier.wait(q_ready.index(qb), (qc // 2) & 1)
            q_buf = q_bufs.index(qb).slice(WG * M, M)
            q_pos = c_off + c_tok0 + r_d % TOK
            # the diagonal region, online, BD keys a tile (masked from the one holding the item's first
            # query on): every row sees a key in the first tile, so every row max is finite there, and
            # that tile starts the sums (no zeroed accumulator, no rescale)
            if PEEL:
                k0, v0, st0 = _kv(k_bufs, v_bufs, k_ready, v_ready, tc, STAGES)
                vd0 = v0.slice(0, BD)
                s0 = _scores(q_buf, k0.slice(0, BD), sd_zero)
                if c_fm <= 0:
                    s0 = gl.where((c_diag_lo * BS + c_d)[None, :] <= q_pos[:, None], s0, float("-inf"))
                m_d = gl.max(s0, 1) * qk_scale
                p0 = gl.exp2(s0 * qk_scale - m_d[:, None])
                l_d = gl.sum(p0, 1)
                acc = warpgroup_mma(gl.convert_layout(p0.to(vd0.dtype), p_layout), vd0, o_zero, use_acc=False,
                                    is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                _release(k_empty, v_empty, st0)
                tc += 1
                t0 = 1
            else:
                m_d = gl.full([M], float("-inf"), gl.float32, sd_rows)
                l_d = gl.zeros([M], gl.float32, sd_rows)
                acc = gl.zeros([M, D], gl.float32, o_layout)
                t0 = 0
            for t in range(t0, c_n_diag):
                k_buf, v_buf, st = _kv(k_bufs, v_bufs, k_ready, v_ready, tc, STAGES)
                vd = v_buf.slice(0, BD)
                sd = _scores(q_buf, k_buf.slice(0, BD), sd_zero)
                if t >= c_fm:
                    kt = c_diag_lo * BS + t * BD + c_d
                    sd = gl.where(kt[None, :] <= q_pos[:, None], sd, float("-inf"))
                m_d, l_d, acc = _online(sd, vd, m_d, l_d, acc, qk_scale, o_rows, p_layout)
                _release(k_empty, v_empty, st)
                tc += 1
            m_i = gl.convert_layout(m_d, s_rows)
            l_i = gl.convert_layout(l_d, s_rows)
            # the listed blocks: against the diagonal's row max held fixed, or online
            if FIXED and PIPE:
                if c_n_off > 0:
                    l_i, acc, tc, gc = _fixed_pipelined(q_buf, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                                        turn, tc, gc, c_n_off, m_i, l_i, acc, s_zero, qk_scale,
                                                        p_layout, STAGES, WG, PP)
            else:
                for u in range(0, c_n_off):
                    k_buf, v_buf, st = _kv(k_bufs, v_bufs, k_ready, v_ready, tc, STAGES)
                    sc = _scores(q_buf, k_buf, s_zero)
                    if FIXED:
                        p = gl.exp2(sc * qk_scale - m_i[:, None])
                        l_i = l_i + gl.sum(p, 1)
                        acc = warpgroup_mma(gl.convert_layout(p.to(v_buf.dtype), p_layout), v_buf, acc,
                                            is_async=True)
                        acc = warpgroup_mma_wait(0, deps=(acc, ))
                    else:
                        m_i, l_i, acc = _online(sc, v_buf, m_i, l_i, acc, qk_scale, o_rows, p_layout)
                    _release(k_empty, v_empty, st)
                    tc += 1
            if FIXED:  # the experiment counts the rows that would need the online redo (p past LIM)
                bad = (l_i > LIM) & (r_s % TOK + c_tok0 < c_q_len)
                gl.atomic_add(BAD + r_s * 0, bad.to(gl.int32), mask=bad, sem="relaxed")
            if not TSTORE:
                mbarrier.arrive(q_empty.index(qb))
                qc += 1
            # epilogue: rows are (head r // TOK, token r % TOK)
            tok = c_tok0 + r_o % TOK
            head = c_h0 + r_o // TOK
            l_o = gl.convert_layout(l_i, o_rows)
            out = acc * (1.0 / l_o)[:, None]
            row_ok = tok < c_q_len
            if TSTORE:  # a whole item: through this partition's rows of its Q buffer (Q is read) by TMA
                if c_tok0 + TOK <= c_q_len:
                    q_buf.store(out.to(o_desc.dtype))
                    fence_async_shared()
                    for j in gl.static_range(M // TOK):
                        tma.async_copy_shared_to_global(o_desc, [c_q_start + c_tok0, (c_h0 + WG * (M // TOK) + j) * D],
                                                        q_buf.slice(j * TOK, TOK))
                    tma.store_wait(0)
                else:
                    o_ptrs = (O + (c_q_start + tok).to(gl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
                              + d_o[None, :])
                    gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
            else:
                o_ptrs = O + (c_q_start + tok).to(gl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d_o[None, :]
                gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
            lse = (gl.convert_layout(m_i, o_rows) + gl.log2(l_o)) * 0.6931471805599453
            gl.store(LSE + (c_q_start + tok).to(gl.int64) * stride_lt + head, lse, mask=row_ok)
            if TSTORE:
                mbarrier.arrive(q_empty.index(qb))
                qc += 1


@gluon.jit
def _attn_ws(q_desc, k_desc, v_desc, kd_desc, vd_desc, o_desc, O, LSE, CU_Q, CU_K, SLOT_SEQ, SLOT_QBLK, IDX, CNT, BAD, n_slots, n_items,
             qk_scale, stride_ot, stride_oh, stride_lt, stride_is, stride_ih, stride_cs,
             G: gl.constexpr, GP: gl.constexpr, TOK: gl.constexpr, BS: gl.constexpr, BN: gl.constexpr,
             D: gl.constexpr, DENSE: gl.constexpr, STAGES: gl.constexpr, LOADER_REGS: gl.constexpr,
             FIXED: gl.constexpr, LIM: gl.constexpr, NWG: gl.constexpr, COMPUTE_REGS: gl.constexpr,
             BD: gl.constexpr, PEEL: gl.constexpr, PIPE: gl.constexpr, TSTORE: gl.constexpr, PP: gl.constexpr,
             num_warps: gl.constexpr):
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
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NWG)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NWG)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=NWG)
    if NWG == 1:
        gl.warp_specialize([
            (_compute, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, O, LSE, o_desc,
                        n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, BAD, qk_scale,
                        stride_ot, stride_oh, stride_lt, stride_cs, G, GP, TOK, BS, BN, BD, D, DENSE, STAGES, FIXED, LIM,
                        0, 1, num_warps, PEEL, PIPE, TSTORE, PP)),
            (_loader, (q_desc, k_desc, v_desc, kd_desc, vd_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                       k_empty, v_ready, v_empty, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, IDX, CNT, stride_is, stride_ih,
                       stride_cs, G, GP, TOK, BS, BN, BD, D, DENSE, STAGES))], [1], [LOADER_REGS])
    else:
        gl.warp_specialize([
            (_compute, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, O, LSE, o_desc,
                        n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, BAD, qk_scale,
                        stride_ot, stride_oh, stride_lt, stride_cs, G, GP, TOK, BS, BN, BD, D, DENSE, STAGES, FIXED, LIM,
                        0, 2, num_warps, PEEL, PIPE, TSTORE, PP)),
            (_compute, (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, O, LSE, o_desc,
                        n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, CNT, BAD, qk_scale,
                        stride_ot, stride_oh, stride_lt, stride_cs, G, GP, TOK, BS, BN, BD, D, DENSE, STAGES, FIXED, LIM,
                        1, 2, num_warps, PEEL, PIPE, TSTORE, PP)),
            (_loader, (q_desc, k_desc, v_desc, kd_desc, vd_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                       k_empty, v_ready, v_empty, n_slots, n_items, SLOT_SEQ, SLOT_QBLK, CU_Q, CU_K, IDX, CNT, stride_is, stride_ih,
                       stride_cs, G, GP, TOK, BS, BN, BD, D, DENSE, STAGES))],
                           [num_warps, 1], [COMPUTE_REGS, LOADER_REGS])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, idx, cnt, scale: float | None = None,
              *, dense: bool = False, gp: int = 4, tok: int = 32, bn: int = 64, stages: int = 4,
              num_warps: int = 8, maxnreg: int = 168, loader_regs: int = 24, nprog: int | None = None,
              fixed: bool = False, bad: torch.Tensor | None = None, nwg: int = 1, compute_regs: int = 216,
              bd: int | None = None, peel: bool = True, pipe: bool = False, tstore: bool = False, pp: bool = False):
    """Same contract as ``kernel.attention`` (out [Tq, Hq, D], lse [Tq, Hq] float32) for q, k, v whose
    heads are packed ([T, H, D] contiguous), D = 128, 16-bit. ``fixed``: the listed blocks against the
    diagonal region's row max held fixed, with no redo: rows whose sum passed the limit are counted
    in ``bad`` (int32 [1]) instead (an experiment's switch, not a kernel's)."""
    # Registers: the CTA's pool is maxnreg x 3 warpgroups; while the partitions start, the loader's
    # group holds loader_regs, the second compute group compute_regs, and the default group asks for
    # 256 (ptxas' setmaxnreg): past the pool, that request spins for ever (a hang, seen with 232).
    assert nwg == 1 or loader_regs + compute_regs + 256 <= 3 * maxnreg, (loader_regs, compute_regs, maxnreg)
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    g = hq // hkv
    bs = layout.block_size
    assert g % gp == 0 and bs % tok == 0 and bs % bn == 0 and q.dtype in (torch.bfloat16, torch.float16)
    for x in (q, k, v):
        assert x.is_contiguous()
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_lay = gl.NVMMASharedLayout.get_default_for([tok, d], gdt)
    kv_lay = gl.NVMMASharedLayout.get_default_for([bn, d], gdt)
    q_desc = TensorDescriptor(q.view(tq, hq * d), [tq, hq * d], [hq * d, 1], [tok, d], q_lay)
    k_desc = TensorDescriptor(k.view(tk, hkv * d), [tk, hkv * d], [hkv * d, 1], [bn, d], kv_lay)
    v_desc = TensorDescriptor(v.view(tk, hkv * d), [tk, hkv * d], [hkv * d, 1], [bn, d], kv_lay)
    bd = bd or bn
    kd_desc = TensorDescriptor(k.view(tk, hkv * d), [tk, hkv * d], [hkv * d, 1], [bd, d], kv_lay)
    vd_desc = TensorDescriptor(v.view(tk, hkv * d), [tk, hkv * d], [hkv * d, 1], [bd, d], kv_lay)
    out = torch.empty_like(q)
    o_desc = TensorDescriptor(out.view(tq, hq * d), [tq, hq * d], [hq * d, 1], [tok, d], q_lay)
    lse = torch.empty(tq, hq, dtype=torch.float32, device=q.device)
    if dense or idx is None:
        idx = cnt = torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device)
        dense = True
    cnt2 = cnt.view(cnt.shape[0], -1)
    n_items = layout.n_slots * (bs // tok) * hkv * (g // gp)
    if nprog is None:
        nprog = torch.cuda.get_device_properties(q.device).multi_processor_count
    nprog = min(nprog, n_items)
    if bad is None:
        bad = torch.zeros(1, dtype=torch.int32, device=q.device)
    lim = 2.0 ** 15 if q.dtype == torch.float16 else 2.0 ** 64
    _attn_ws[(nprog,)](
        q_desc, k_desc, v_desc, kd_desc, vd_desc, o_desc, out, lse, layout.cu_q, layout.cu_k, layout.slot_seq, layout.slot_qblk, idx, cnt2,
        bad,
        layout.n_slots, n_items, scale * LOG2E, out.stride(0), out.stride(1), lse.stride(0),
        idx.stride(0), idx.stride(1), cnt2.stride(0),
        G=g, GP=gp, TOK=tok, BS=bs, BN=bn, D=d, DENSE=dense, STAGES=stages, LOADER_REGS=loader_regs,
        FIXED=fixed, LIM=lim, NWG=nwg, COMPUTE_REGS=compute_regs, BD=bd, PEEL=peel, PIPE=bool(pipe) and fixed, TSTORE=bool(tstore),
        PP=bool(pp) and bool(pipe) and fixed and nwg == 2,
        num_warps=num_warps if nwg == 1 else 4,
        maxnreg=maxnreg)
    return out, lse

"""Block layout of a packed variable-length batch, built on the device with no host sync.

A batch is packed: q [Tq, Hq, D], k/v [Tk, Hkv, D], ``cu_seqlens_q``/``cu_seqlens_k`` int32 [B+1].
Sequence b has q_len_b <= k_len_b; its queries are the LAST q_len_b positions of its keys
(chunked prefill over earlier chunks), so query i sits at key position k_len_b - q_len_b + i.

Query blocks ("slots") are ``block_size`` consecutive queries of one sequence, counted from the
sequence's first query. Key blocks are ``block_size`` consecutive keys counted from key position 0.
Slots of all sequences are numbered one after the other; the slot count is bounded statically by
Tq // bs + B (each sequence wastes at most one partial block), so nothing needs the per-sequence
lengths on the host. Unused trailing slots have ``slot_seq == -1``. Key-block slots ("kslots")
number the key blocks of all sequences the same way.

For slot (b, j): its queries sit at key positions [a, e] with a = k_len - q_len + j*bs and
e = min(a + bs, k_len) - 1. Key blocks < ``a // bs`` lie wholly before every query of the slot: those
are the *selectable* blocks of the block-sparse mask. Key blocks ``a // bs`` ... ``e // bs`` (one, or two
when a is not a multiple of bs) form the *diagonal region*; it is always computed, with the causal mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Layout:
    block_size: int
    batch: int
    total_q: int
    total_k: int
    cu_q: torch.Tensor  # int32 [B+1]
    cu_k: torch.Tensor  # int32 [B+1]
    n_slots: int  # static bound on query blocks of the batch
    slot_seq: torch.Tensor  # int32 [n_slots], -1 for unused slots
    slot_qblk: torch.Tensor  # int32 [n_slots], query block index within its sequence
    n_kslots: int  # static bound on key blocks of the batch
    kslot_seq: torch.Tensor  # int32 [n_kslots], -1 for unused
    kslot_kblk: torch.Tensor  # int32 [n_kslots]
    kb_start: torch.Tensor  # int32 [B], first kslot of each sequence
    max_kblocks: int  # static bound on key blocks of one sequence (capacity of an index row)

    @property
    def device(self) -> torch.device:
        return self.cu_q.device


def _slot_map(cu: torch.Tensor, bs: int, n: int):
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    nblk = (lens + bs - 1) // bs
    starts = torch.zeros(nblk.numel() + 1, dtype=torch.int64, device=cu.device)
    starts[1:] = torch.cumsum(nblk, 0)
    ids = torch.arange(n, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(starts[1:].contiguous(), ids, right=True)
    used = seq < nblk.numel()
    seq_c = seq.clamp(max=max(nblk.numel() - 1, 0))
    blk = ids - starts[seq_c]
    seq = torch.where(used, seq, torch.full_like(seq, -1))
    blk = torch.where(used, blk, torch.zeros_like(blk))
    return seq.to(torch.int32), blk.to(torch.int32), starts[:-1].to(torch.int32)


def build_layout(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                 block_size: int = 128) -> Layout:
    """Device-side slot maps for a packed batch. ``total_q``/``total_k`` are q.shape[0]/k.shape[0]."""
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise ValueError("cu_seqlens must be int32 tensors of shape [B+1]")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both have shape [B+1]")
    b = cu_seqlens_q.numel() - 1
    bs = block_size
    n_slots = max(total_q // bs + b, 1)
    n_kslots = max(total_k // bs + b, 1)
    slot_seq, slot_qblk, _ = _slot_map(cu_seqlens_q, bs, n_slots)
    kslot_seq, kslot_kblk, kb_start = _slot_map(cu_seqlens_k, bs, n_kslots)
    return Layout(bs, b, total_q, total_k, cu_seqlens_q, cu_seqlens_k, n_slots, slot_seq, slot_qblk,
                  n_kslots, kslot_seq, kslot_kblk, kb_start, max(cdiv(total_k, bs), 1))


def slot_geometry(layout: Layout):
    """Per-slot (diag_lo, diag_hi, valid) on the device: selectable key blocks are [0, diag_lo),
    the diagonal region is [diag_lo, diag_hi]."""
    bs = layout.block_size
    seq = layout.slot_seq.clamp(min=0).long()
    q_len = (layout.cu_q[1:] - layout.cu_q[:-1])[seq].long()
    k_len = (layout.cu_k[1:] - layout.cu_k[:-1])[seq].long()
    a = k_len - q_len + layout.slot_qblk.long() * bs
    e = torch.minimum(a + bs, k_len) - 1
    return a // bs, e // bs, layout.slot_seq >= 0


def causal_block_count(layout: Layout) -> torch.Tensor:
    """Number of key blocks a dense causal computation touches, summed over slots (device scalar)."""
    lo, hi, valid = slot_geometry(layout)
    return torch.where(valid, hi + 1, torch.zeros_like(hi)).sum()

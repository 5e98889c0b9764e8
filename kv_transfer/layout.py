"""KV page layouts on the wire: where the bytes of page (layer l, block b) live on each side, the
NIXL descriptors that move one side's pages into the other's, and the conversion when they differ.

vLLM 0.32 (``vllm/v1/kv_cache_layout.py``, ``v1/kv_cache_interface.py``) views every attention
layer's cache as a logical ``[B, H, N, C]`` tensor (blocks, KV heads, tokens per block, C = K|V:
K channels then V channels of one token, 2*D elements); the physical order is one of the
``KVCacheLayout`` stride permutations of ``[L, B, H, N, C]``:

    name    physical order     one (layer, block) page                      who uses it
    LBHNC   [L, B, H, N, C]    dense [H, N, C]                              CPU_ATTN; FlashInfer "HND";
                                                                            our pool; stock NixlConnector
    LBNHC   [L, B, N, H, C]    dense [N, H, C]                              FLASH_ATTN / TRITON default
                                                                            ("NHD"), flex, hpc
    BLHNC   [B, L, H, N, C]    dense [H, N, C], blocks L pages apart        FlashInfer (Blackwell)
    BLNHC   [B, L, N, H, C]    dense [N, H, C], blocks L pages apart
    BHLNC   [B, H, L, N, C]    H runs of [N, C], heads L runs apart
    LHBNC   [L, H, B, N, C]    H runs of [N, C], heads NB runs apart        ROCm

C is innermost in all of them, so a side is fully described by its per-layer base addresses and
three byte strides (block, head, token): ``Addressing``. We always send our pool's page as it is
([H, N, C], K after RoPE); what the destination needs:
- dense [H, N, C] pages: one descriptor per page (runs of contiguous blocks coalesce);
- H runs of [N, C]: one descriptor per head and page, no conversion;
- dense [N, H, C] pages: one descriptor per page, then ``convert_received`` permutes the received
  blocks in place on the decode before vLLM may read them (vLLM's own NixlConnector does the same
  with ``enable_permute_local_kv``).
A decode's kernels read ``cache[b, h, n, :D]`` (K) and ``cache[b, h, n, D:]`` (V) through the view's
strides (FLASH_ATTN: ``kv_cache.transpose(1, 2).split(D, -1)``): after the transfer (and the
conversion) exactly those bytes hold token ``b * N + n``'s K/V of head h.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kv_transfer import wire

LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC", "LHBNC")
_ALIASES = {"HNC": "LBHNC", "HND": "LBHNC", "NHD": "LBNHC"}  # wire v1 / FlashInfer names
# the arrangement inside one page: "HNC" dense [H, N, C]; "NHC" dense [N, H, C]; "H|NC" H runs of [N, C]
_INTERIOR = {"LBHNC": "HNC", "BLHNC": "HNC", "LBNHC": "NHC", "BLNHC": "NHC", "BHLNC": "H|NC", "LHBNC": "H|NC"}


def canonical(name: str) -> str:
    """vLLM's layout name for ``name`` (accepts "HND", "NHD", "HNC"); ValueError if unknown."""
    n = _ALIASES.get(name, name)
    if n not in _INTERIOR:
        raise ValueError(f"unknown KV page layout {name!r}; known: {', '.join(LAYOUTS)}")
    return n


@dataclass(frozen=True)
class Addressing:
    """Where one side keeps its KV: element (layer l, block b, head h, token n, channel c) is at
    ``layer_addrs[l] + b * block_stride + h * head_stride + n * token_stride + c * itemsize``."""

    layout: str
    layer_addrs: tuple[int, ...]
    block_stride: int
    head_stride: int
    token_stride: int
    num_heads: int
    block_size: int
    row_bytes: int  # C * itemsize: one token of one head, K then V

    @property
    def page_bytes(self) -> int:
        return self.num_heads * self.block_size * self.row_bytes

    @property
    def interior(self) -> str:
        return _INTERIOR[self.layout]


def dense_strides(layout: str, num_heads: int, block_size: int, row_bytes: int) -> tuple[int, int]:
    """(head_stride, token_stride) of a dense page of ``layout``; ValueError for head-split ones."""
    interior = _INTERIOR[canonical(layout)]
    if interior == "HNC":
        return block_size * row_bytes, row_bytes
    if interior == "NHC":
        return row_bytes, num_heads * row_bytes
    raise ValueError(f"layout {layout} keeps heads apart: give its head stride")


def check(a: Addressing) -> str | None:
    """Why ``a`` is not an addressing we can write into or read from, or None."""
    r, h, n = a.row_bytes, a.num_heads, a.block_size
    ok = {"HNC": a.token_stride == r and a.head_stride == n * r,
          "NHC": a.head_stride == r and a.token_stride == h * r,
          "H|NC": a.token_stride == r and (h == 1 or a.head_stride >= n * r)}[a.interior]
    if not ok or a.block_stride <= 0:
        return (f"strides (block {a.block_stride}, head {a.head_stride}, token {a.token_stride} bytes) "
                f"do not fit page layout {a.layout} with {h} heads x {n} tokens x {r} bytes")
    if a.interior != "H|NC" and a.block_stride < a.page_bytes:
        return f"block stride {a.block_stride} is smaller than a {a.layout} page ({a.page_bytes} bytes)"
    return None


def describe(caches: Sequence[torch.Tensor], layout: str | None = None) -> Addressing:
    """The addressing of a decode's per-layer cache views (vLLM's logical ``[B, H, N, 2D]``, any of
    ``LAYOUTS``). ``layout``: the name vLLM resolved, checked against the strides. ValueError if
    the views are not one of the layouts."""
    c0 = caches[0]
    if c0.dim() != 4 or any(c.shape != c0.shape or c.stride() != c0.stride() or c.dtype != c0.dtype
                            for c in caches):
        raise ValueError("KV caches must be per-layer [num_blocks, heads, block_size, 2*head_dim] views "
                         "of one shape, dtype and strides")
    it = c0.element_size()
    sb, sh, sn, sc = (s * it for s in c0.stride())
    _, h, n, c = c0.shape
    row = c * it
    if sc != it:
        raise ValueError("KV cache channels (K|V) must be contiguous")
    if sn == row and sh == n * row:
        name = "LBHNC" if sb == h * n * row else "BLHNC"
    elif sh == row and sn == h * row:
        name = "LBNHC" if sb == h * n * row else "BLNHC"
    elif sn == row:
        name = "LHBNC" if sb == n * row else "BHLNC"
    else:
        raise ValueError(f"KV cache strides {tuple(c0.stride())} match none of the page layouts {LAYOUTS}")
    if layout is not None and canonical(layout) != name:
        if _INTERIOR[canonical(layout)] != _INTERIOR[name]:
            raise ValueError(f"vLLM says the KV cache layout is {layout}, its strides say {name}")
        name = canonical(layout)  # e.g. one block or one layer: L/B order is not visible
    a = Addressing(name, tuple(t.data_ptr() for t in caches), sb, sh, sn, h, n, row)
    if why := check(a):
        raise ValueError(why)
    return a


def of_wire(page_layout: str, layer_addrs: Sequence[int], block_stride: int, head_stride: int,
            token_stride: int, g: wire.Geometry) -> Addressing:
    """The addressing a Register or Offer describes (strides 0: the layout's dense page);
    ValueError if it is not consistent."""
    name = canonical(page_layout)
    row = g.page_bytes // (g.num_kv_heads * g.block_size)
    if head_stride == 0 and token_stride == 0:
        head_stride, token_stride = dense_strides(name, g.num_kv_heads, g.block_size, row)
    a = Addressing(name, tuple(layer_addrs), block_stride, head_stride, token_stride, g.num_kv_heads,
                   g.block_size, row)
    if why := check(a):
        raise ValueError(why)
    return a


def page_chunks(dst: Addressing) -> np.ndarray:
    """[K, 3] (source offset, destination offset, bytes) that move one of our dense [H, N, C] pages
    into a page of ``dst`` (for "NHC" raw, to be converted by ``convert_received``)."""
    if dst.interior == "H|NC" and dst.num_heads > 1:
        run = dst.block_size * dst.row_bytes
        h = np.arange(dst.num_heads, dtype=np.int64)
        return np.stack([h * run, h * dst.head_stride, np.full_like(h, run)], axis=1)
    return np.array([[0, 0, dst.page_bytes]], dtype=np.int64)


def descs(src_addr: np.ndarray, dst_addr: np.ndarray, chunks: np.ndarray, src_dev: int,
          dst_dev: int) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 (addr, len, dev) descriptor pairs moving page i at src_addr[i] to dst_addr[i], chunk by
    chunk, merged into one descriptor wherever consecutive pieces are contiguous on BOTH sides."""
    src_addr, dst_addr = np.asarray(src_addr, dtype=np.int64), np.asarray(dst_addr, dtype=np.int64)
    s = (src_addr[:, None] + chunks[None, :, 0]).reshape(-1)
    d = (dst_addr[:, None] + chunks[None, :, 1]).reshape(-1)
    ln = np.broadcast_to(chunks[None, :, 2], (len(src_addr), len(chunks))).reshape(-1)
    if len(s) == 0:
        return np.zeros((0, 3), dtype=np.uint64), np.zeros((0, 3), dtype=np.uint64)
    joins = (s[1:] == s[:-1] + ln[:-1]) & (d[1:] == d[:-1] + ln[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(ln, starts)
    src = np.stack([s[starts], lengths, np.full_like(lengths, src_dev)], axis=1).astype(np.uint64)
    dst = np.stack([d[starts], lengths, np.full_like(lengths, dst_dev)], axis=1).astype(np.uint64)
    return src, dst


def needs_conversion(dst: Addressing) -> bool:
    """True if pages arrive as [H, N, C] bytes and must be permuted (``convert_received``)."""
    return dst.interior == "NHC"


def convert_received(cache: torch.Tensor, block_ids: Sequence[int]) -> None:
    """In place: the pages ``block_ids`` of one layer's [N, H, C]-interior cache view received our
    [H, N, C] page bytes; rewrite them so ``cache[b, h, n]`` reads head h, token n."""
    if not len(block_ids):
        return
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
    _, h, n, c = cache.shape
    raw = cache.index_select(0, idx).transpose(1, 2).contiguous()  # [b, N, H, C]: memory order
    cache.index_copy_(0, idx, raw.view(-1, h, n, c))  # the bytes were [H, N, C]

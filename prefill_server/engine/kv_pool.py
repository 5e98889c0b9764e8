"""Paged KV pool: block allocation, page layout, and leases on finished requests' blocks.

Memory: one contiguous tensor ``kv[L, num_blocks, H, N, 2*D]`` (layers, blocks, KV heads, tokens per
block, K then V channels), in the model's dtype or, for a decode with an FP8 KV cache, in e4m3
(``kv_format.py``: quantized on write, dequantized on read). One block of one layer is vLLM 0.32's page ``[H, N, K|V]`` ("LBHNC"), so a
decode reads it with one descriptor per (layer, run of contiguous blocks). The whole tensor is one
region to register with NIXL.

Ownership: the engine allocates blocks for a request while it is prefilled; when the prefill
finishes, the blocks pass to a *lease* keyed by the request id. A lease ends by ``release`` (the
decode's notification that it has read them, an abort, an explicit Release call) or by expiry (the
decode never came; heartbeats extend it). Every path ends in ``free``: nothing is stranded.

References: every block has a count of its holders (a running sequence, a lease, a stream's
staging). ``allocate`` hands out blocks with one reference; ``acquire_prefix`` adds one to cached
blocks a new prompt shares; ``free`` drops one. At zero a block goes back to the free list, or, if
the prefix cache names it (``prefix_cache.py``), to the cache's LRU, from which ``allocate``
evicts only when the free list is empty. So a block in use is never evicted, and a free of a block
no one holds (a double free) fails an assertion instead of corrupting another request's KV.

Host tier (``host_cache.py``, ``host_cache_bytes`` > 0): an evicted block's K/V is copied to host
memory under its name before the block is reused, and ``acquire_prefix`` brings such blocks back
(into fresh blocks, named again) when a prompt's cached head runs past what the pool still holds.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from prefill_server.engine.host_cache import HostTier
from prefill_server.engine.kv_format import KVFormat, canonical
from prefill_server.engine.prefix_cache import PrefixCache
from prefill_server.errors import PoolExhausted
from prefill_server.layers import fused
from prefill_server.layers.fp8 import to_e4m3


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    expires_at: float  # time.monotonic() deadline
    num_tokens: int = 0
    meta: dict = field(default_factory=dict)
    created_at: float = field(default_factory=time.monotonic)


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 cache_salt: bytes | None = None, host_cache_bytes: int = 0, cache_dtype: str = "auto"):
        """dtype: the model's, what K/V are computed in. cache_dtype: how pages store them
        (``kv_format``: "auto", the model's dtype; "fp8" / "fp8_e4m3", vLLM's FP8 KV cache); ``dtype``
        becomes the pages' element type. cache_salt: turns the prefix cache on
        (``prefix_cache.salt_of``: model, dtype, block size). host_cache_bytes: host memory for
        blocks the prefix cache evicts (0: none)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_layers, self.num_blocks = num_layers, num_blocks
        self.num_kv_heads, self.block_size, self.head_dim = num_kv_heads, block_size, head_dim
        self.format = KVFormat.of(cache_dtype, dtype)
        self.compute_dtype, self.cache_dtype = dtype, self.format.cache_dtype
        self.dtype, self.device = self.format.storage_dtype, torch.device(device)
        # kv: [L, NB, H, N, 2D]
        self.kv = torch.zeros(num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim,
                              dtype=self.dtype, device=self.device)
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._ref = [0] * num_blocks  # holders of each block
        self.cache_salt = cache_salt
        self.cache: PrefixCache | None = PrefixCache() if cache_salt is not None else None
        self.host: HostTier | None = None
        if self.cache is not None and host_cache_bytes > 0:
            self.host = HostTier.of_bytes(host_cache_bytes, tuple(self.kv.shape[:1] + self.kv.shape[2:]), self.dtype,
                                          pin=self.device.type == "cuda")
        self._leases: dict[str, Lease] = {}
        self.expired_total = 0
        # called (lease, expired: bool) after a lease's blocks are freed; for metrics
        self.on_lease_end: Callable[[Lease, bool], None] | None = None

    # ---- geometry (what a peer needs to address pages) ----
    def stores(self, cache_dtype: str) -> bool:
        """Whether a decode running ``--kv-cache-dtype cache_dtype`` reads these pages as its own."""
        return canonical(cache_dtype, self.compute_dtype) == self.cache_dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer: H * N * 2D * itemsize."""
        return self.num_kv_heads * self.block_size * 2 * self.head_dim * self.kv.element_size()

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def layer_base_addr(self, layer: int) -> int:
        return self.kv.data_ptr() + layer * self.layer_bytes

    def layer_view(self, layer: int) -> torch.Tensor:
        """[NB, H, N, 2D] view of one layer's pages."""
        return self.kv[layer]

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- allocation ----
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones and cached ones no one references."""
        with self._lock:
            return self._num_free()

    def _num_free(self) -> int:  # lock held
        return len(self._free) + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_used(self) -> int:
        """Blocks someone references."""
        return self.num_blocks - self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks, one reference each: free ones first, then the least recently used unreferenced
        cached ones (evicted)."""
        with self._lock:
            if n > self._num_free():
                raise PoolExhausted(f"KV pool has {self._num_free()} free blocks, {n} needed")
            out = [self._take_block() for _ in range(n)]
            for b in out:
                assert self._ref[b] == 0, f"KV block {b} handed out while referenced"
                self._ref[b] = 1
            return out

    def _take_block(self) -> int:  # lock held; a block is free or evictable
        if self._free:
            return self._free.pop()
        block, name = self.cache.evict()
        if self.host is not None:
            self.host.put(name, self.kv[:, block])  # [L, H, N, 2D], before the block is rewritten
        return block

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. Last blocks first: a prompt's tail is evicted before
        its head, which more prompts share."""
        with self._lock:
            for b in reversed(block_ids):
                assert self._ref[b] > 0, f"double free of KV block {b}"
                self._ref[b] -= 1
                if self._ref[b]:
                    continue
                if self.cache is not None and self.cache.is_cached(b):
                    self.cache.park(b)
                else:
                    self._free.append(b)

    def refcount(self, block: int) -> int:
        with self._lock:
            return self._ref[block]

    # ---- prefix cache (``cache`` is None when off) ----
    def acquire_prefix(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of leading ``hashes``, one reference added to each
        (the caller frees them like its own blocks)."""
        if self.cache is None:
            return []
        with self._lock:
            blocks = self.cache.match(hashes)
            for b in blocks:
                self._hold(b)
            if self.host is not None:
                blocks += self._restore(hashes[len(blocks):])
            return blocks

    def _hold(self, b: int) -> None:  # lock held; b is cached
        if self._ref[b] == 0:
            self.cache.unpark(b)
        self._ref[b] += 1

    def _restore(self, hashes: list[bytes]) -> list[int]:
        """Continue a cached run from the host tier (and the pool's cache where a later block is
        there again): each block copied back into a fresh block, named and held. Stops at the
        first name found in neither, or when no block can be had."""
        out = []
        for h in hashes:
            if (b := self.cache.match([h])):
                self._hold(b[0])
                out.append(b[0])
                continue
            if h not in self.host or not self._num_free():
                break
            b = self._take_block()  # (its eviction may spill a block to the host tier, dropping h)
            if not self.host.take(h, self.kv[:, b]):
                self._free.append(b)
                break
            self._ref[b] = 1
            inserted = self.cache.insert(b, h)
            assert inserted, f"restored block {h.hex()} is cached twice"
            out.append(b)
        return out

    def cache_blocks(self, block_ids: list[int], hashes: list[bytes]) -> int:
        """Name computed full blocks (``block_ids[i]`` holds the block ``hashes[i]`` names; the
        caller references them); returns how many were new to the cache."""
        if self.cache is None:
            return 0
        with self._lock:
            new = 0
            for b, h in zip(block_ids, hashes):
                assert self._ref[b] > 0, f"caching KV block {b}, which no one holds"
                new += self.cache.insert(b, h)
            return new

    def reset_cache(self) -> int:
        """Forget every cached block (the admin reset); returns how many were freed at once. Blocks
        in use stay with their holders, as ordinary blocks."""
        if self.cache is None:
            return 0
        with self._lock:
            freed = self.cache.reset()
            self._free.extend(freed)
            if self.host is not None:
                self.host.reset()
            return len(freed)

    def check(self) -> None:
        """Every block exactly once: free, cached and unreferenced, or referenced (tests)."""
        with self._lock:
            free, parked = set(self._free), self.cache.parked() if self.cache else set()
            assert len(free) == len(self._free), "a block is twice in the free list"
            assert not free & parked, "a block is both free and cached"
            for b in range(self.num_blocks):
                held = self._ref[b] > 0
                assert held + (b in free) + (b in parked) == 1, f"block {b}: ref {self._ref[b]}, " \
                    f"free {b in free}, parked {b in parked}"
                assert not (b in free and self.cache is not None and self.cache.is_cached(b))

    # ---- page I/O ----
    def slot_mapping(self, block_ids: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block index, offset) per token position in [start, end) of a request owning block_ids."""
        # on the pool's device: no host-side indexing per token before a step's first kernel
        need = -(-end // self.block_size)
        if len(block_ids) < need:  # (checked here: out of range on the GPU is a device-side assert)
            raise ValueError(f"{len(block_ids)} blocks hold fewer than the {end} tokens asked for")
        pos = torch.arange(start, end, device=self.device)
        table = torch.tensor(block_ids[:need], dtype=torch.long).to(self.device)
        return table[pos // self.block_size], pos % self.block_size

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, H, D] written at (blocks[t], offsets[t])."""
        self._write(self.kv[layer], blocks, offsets, k, v)  # page [NB, H, N, 2D]

    def write_flat(self, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, H, D] written at (flat page pages[t], offsets[t]); see ``stream_pages``."""
        self._write(self.kv.view(-1, *self.kv.shape[2:]), pages, offsets, k, v)

    def _write(self, page: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> None:
        d, f = self.head_dim, self.format
        # one pass on CUDA (a cast, or FP8 pages' saturating quantization, as ``f.store``)
        scales = (f.k_scale, f.v_scale) if f.quantized else None
        if fused.available(page) and fused.kv_write(page, blocks, offsets, k, v, scales):
            return
        page[blocks, :, offsets, :d] = f.store(k, f.k_scale)
        page[blocks, :, offsets, d:] = f.store(v, f.v_scale)

    # ---- streaming (push) staging: a few layers of one prompt, not all of them ----
    # The pool seen as flat pages kv.view(L * NB, H, N, 2D): page (layer l, block b) = l * NB + b.
    # A streamed prompt of m pages keeps ``slots`` layers in flight, i.e. slots * m pages, carved
    # out of ceil(slots * m / L) whole blocks: a prompt larger than the pool still fits.
    def stream_blocks_needed(self, num_tokens: int, slots: int) -> int:
        return -(-slots * self.blocks_needed(num_tokens) // self.num_layers)

    def stream_pages(self, block_ids: list[int], num_tokens: int, slot: int, slots: int) -> list[int]:
        """Flat page indices [m] for staging slot ``slot`` of a prompt owning ``block_ids``."""
        m, k = self.blocks_needed(num_tokens), len(block_ids)
        assert k >= self.stream_blocks_needed(num_tokens, slots) and 0 <= slot < slots
        out = []
        for i in range(m):
            p = slot * m + i
            out.append((p // k) * self.num_blocks + block_ids[p % k])
        return out

    read_one_copy = True  # how ``read`` gathers (the same values either way; timed on the H200)

    def block_table(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The first blocks of ``block_ids`` that hold ``num_tokens`` tokens, as an index tensor on
        the pool's device, for ``read``: built once per step, not per layer (on CUDA through pinned
        memory, without a host sync: a pageable copy syncs, 32 times a step when made per layer)."""
        need = self.blocks_needed(num_tokens)
        if len(block_ids) < need:
            raise ValueError(f"{len(block_ids)} blocks hold fewer than the {num_tokens} tokens asked for")
        table = torch.tensor(block_ids[:need], dtype=torch.long)
        if self.device.type == "cuda":
            return table.pin_memory().to(self.device, non_blocking=True)  # (the host allocator keeps
        return table.to(self.device)  # the pinned block until the copy is done)

    def read(self, layer: int, block_ids: list[int] | None, num_tokens: int,
             table: torch.Tensor | None = None, k_codes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the first num_tokens tokens of a request: each [T, H, D] in the compute dtype
        (views of one copy; from FP8 pages, dequantized copies).
        table: ``block_table(block_ids, n)`` for some n >= num_tokens, made once for many reads
        (block_ids is then not looked at). k_codes: K as e4m3 codes of K / k_scale instead (attention's
        FP8 scores): FP8 pages' own bytes, or the codes of pages in the model's dtype (k_scale 1.0)."""
        if table is None:
            table = self.block_table(block_ids, num_tokens)
        idx = table[: self.blocks_needed(num_tokens)]
        if self.read_one_copy:  # one gather, straight into token order [b, N, H, 2D]
            flat = self.kv[layer].transpose(1, 2).index_select(0, idx).view(-1, self.num_kv_heads, 2 * self.head_dim)
        else:  # a gather [b, H, N, 2D], then a permute copy
            pages = self.kv[layer].index_select(0, idx)
            flat = pages.permute(0, 2, 1, 3).reshape(-1, self.num_kv_heads, 2 * self.head_dim)
        flat, f = flat[:num_tokens], self.format
        k = flat[..., : self.head_dim]
        if k_codes:
            k = k if f.quantized else to_e4m3(k, f.k_scale)
        else:
            k = f.load(k, f.k_scale)
        return k, f.load(flat[..., self.head_dim:], f.v_scale)

    # ---- leases ----
    def lease(self, request_id: str, block_ids: list[int], ttl_s: float, num_tokens: int = 0,
              meta: dict | None = None) -> Lease:
        with self._lock:
            assert request_id not in self._leases, f"lease {request_id} exists"
            lease = Lease(request_id, list(block_ids), time.monotonic() + ttl_s, num_tokens, meta or {})
            self._leases[request_id] = lease
            return lease

    def extend(self, request_id: str, ttl_s: float) -> bool:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            lease.expires_at = max(lease.expires_at, time.monotonic() + ttl_s)
            return True

    def get_lease(self, request_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(request_id)

    def release(self, request_id: str) -> bool:
        """End a lease and free its blocks; False if no such lease (already freed)."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self.free(lease.block_ids)
        self._ended(lease, expired=False)
        return True

    def _ended(self, lease: Lease, expired: bool) -> None:
        if self.on_lease_end is not None:
            try:
                self.on_lease_end(lease, expired)
            except Exception:  # a metrics hook never breaks freeing
                pass

    def expire(self, now: float | None = None) -> list[str]:
        """Free every lease past its deadline; returns their request ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = [rid for rid, lz in self._leases.items() if lz.expires_at <= now]
            leases = [self._leases.pop(rid) for rid in dead]
        for lz in leases:
            self.free(lz.block_ids)
            self._ended(lz, expired=True)
        self.expired_total += len(dead)
        return dead

    @property
    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

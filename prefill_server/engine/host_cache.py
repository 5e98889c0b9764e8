"""The prefix cache's second tier: cached blocks evicted from the KV pool, kept in host memory.

A prefill tier whose pool is small next to its traffic's working set (long documents, many agents'
histories) loses its cached heads to eviction long before they stop being asked for. With
``--host-cache-gib`` an evicted block's K/V (every layer) is copied here, under the name the prefix
cache gave it, before the pool reuses the block; a later prompt whose head runs past the pool's
cached blocks finds the rest here and gets it copied back into fresh pool blocks, cheaper than
recomputing it (SGLang's HiCache and LMCache keep such a tier).

Bounded: ``capacity`` blocks in one preallocated tensor (pinned when the pool is on a GPU, so the
copies run at full PCIe speed), least recently stored dropped first. A block is in one tier at a
time: restoring it moves it back to the pool's cache. The copies run on the caller's thread and the
pool's stream (the engine's), so they are ordered with the forward that wrote or will read the
pages. Off by default: every eviction then costs a copy, also for traffic that never hits.
Not thread-safe: ``KVPool``'s lock guards every call.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    def __init__(self, capacity: int, page_shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        """page_shape: one block of every layer, ``[L, H, N, 2D]``."""
        assert capacity > 0
        self.capacity = capacity
        self.store = torch.empty((capacity, *page_shape), dtype=dtype, pin_memory=pin)  # [C, L, H, N, 2D]
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # name -> slot, least recently stored first
        self._free = list(range(capacity - 1, -1, -1))
        self.stored = self.restored = self.dropped = 0  # blocks, since start

    @classmethod
    def of_bytes(cls, nbytes: int, page_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> HostTier | None:
        """A tier of as many blocks as ``nbytes`` holds (None: not one)."""
        per_block = dtype.itemsize
        for d in page_shape:
            per_block *= d
        n = nbytes // per_block
        return cls(n, page_shape, dtype, pin) if n > 0 else None

    @property
    def num_blocks(self) -> int:
        return len(self._slot_of)

    def __contains__(self, name: bytes) -> bool:
        return name in self._slot_of

    def put(self, name: bytes, page: torch.Tensor) -> None:
        """Keep ``page`` ([L, H, N, 2D], the evicted block's K/V) under ``name``."""
        if name in self._slot_of:
            self._slot_of.move_to_end(name)
            return
        if not self._free:
            _, slot = self._slot_of.popitem(last=False)
            self._free.append(slot)
            self.dropped += 1
        slot = self._free.pop()
        self.store[slot].copy_(page)
        self._slot_of[name] = slot
        self.stored += 1

    def take(self, name: bytes, into: torch.Tensor) -> bool:
        """Copy the block named ``name`` into ``into`` ([L, H, N, 2D], a pool block) and forget it
        here; False when it is not here."""
        slot = self._slot_of.pop(name, None)
        if slot is None:
            return False
        into.copy_(self.store[slot])
        self._free.append(slot)
        self.restored += 1
        return True

    def reset(self) -> None:
        self._free.extend(self._slot_of.values())
        self._slot_of.clear()

"""Writing into an SGLang decode: our pool's pages are ``[kv_heads, block_size, K|V]`` (K and V
interleaved per token), SGLang's are token-major K and V buffers apart (``[tokens, kv_heads,
head_dim]`` each). Copied as they are, every (token, head) would need its own descriptor; so each
layer is first converted on our side (one gather on the pool's device) into a registered area laid
out as SGLang's, then written with one descriptor per run of consecutive decode pages, per K and V.

The poster thread of ``kv_transfer.push.writer.LayerWriter`` calls ``SGLangTarget.layer_descs``
(conversion included) once the layer's K/V are ready; the area has ``slots`` layer slots, reused
(layer % slots) only once the WRITE that last read a slot is over. ``AuxRows`` holds the rows our
aux WRITE sends (first token, room, logprobs), one row set per finishing request.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_transfer.base import KVPages
from kv_transfer.nixl import device_id_of
from kv_transfer.push.writer import PushRequest
from kv_transfer.sglang import v0_5_23 as wire
from kv_transfer.sglang.peers import Destination, Geometry
from prefill_server.errors import TransferError


@dataclass
class SGLangRequest(PushRequest):
    """One room's transfer (the writer's ``PushRequest`` plus what SGLang needs)."""

    room: int = 0
    dest: Destination | None = None  # set once its transfer info is accepted (READY)
    aux_slot: int = -1  # our AuxRows slot while the aux WRITE may read it
    status_sent: bool = False
    decode_aborted: bool = False  # the decode sent ABORT: it expects an ABORT_ACK, not a status
    ack_targets: list[tuple[str, int, int]] = field(default_factory=list)  # decode ABORTs owed an ABORT_ACK


AUX = -1  # the writer's handle key of the aux WRITE (layers are 0..L-1)


class ConvertArea:
    """``[slots, 2 (K, V), rows, kv_heads, head_dim]`` on the pool's device: one converted layer per
    slot, K rows then V rows, token-major (each a contiguous run of ``row_bytes``). A layer is
    converted whole blocks at a time (row 0 is the first token of the first block sent), so
    ``rows`` is ``max_tokens`` plus one block."""

    def __init__(self, pool: KVPages, max_tokens: int, slots: int = 2):
        self.pool, self.slots, self.max_tokens = pool, slots, max_tokens
        h, d = pool.num_kv_heads, pool.head_dim
        self.tensor = torch.zeros(slots, 2, max_tokens + pool.block_size, h, d, dtype=pool.dtype,
                                  device=pool.kv.device)
        self._flat = pool.kv.view(-1, h, pool.block_size, 2 * d)  # [L * NB, H, N, 2D]: flat pages
        # its own CUDA stream: waiting for the copy never waits for the forward's later layers
        self._stream = torch.cuda.Stream(pool.kv.device) if pool.kv.is_cuda else None
        self._owner: list[tuple[PushRequest, int] | None] = [None] * slots  # the last WRITE from each slot

    def base(self, slot: int, kv: int) -> int:
        return self.tensor[slot, kv].data_ptr()

    def claim(self, slot: int, p: PushRequest, layer: int, in_flight: Callable[[PushRequest, int], bool],
              timeout_s: float) -> None:
        """Wait until the WRITE that last read ``slot`` is over (``in_flight(req, layer)`` polls it),
        then make (p, layer) its user. TransferError past ``timeout_s``."""
        deadline, delay = time.monotonic() + timeout_s, 0.0002
        while (owner := self._owner[slot]) is not None and in_flight(*owner):
            if time.monotonic() >= deadline:
                raise TransferError(f"conversion slot {slot} still read by a WRITE after {timeout_s:g} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
        self._owner[slot] = (p, layer)

    def convert(self, slot: int, pages: torch.Tensor | slice) -> None:
        """One layer's flat pool pages (a slice when they are consecutive) into ``slot``: one
        gather of whole pages (none for a slice) and one permuting copy, K and V at once."""
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            src = self._flat[pages] if isinstance(pages, slice) else self._flat.index_select(0, pages)
            b, h, n, d2 = src.shape  # [b, H, N, 2D]
            d = d2 // 2
            dst = self.tensor[slot, :, : b * n].view(2, b, n, h, d)  # [K|V, b, N, H, D]
            dst.copy_(src.view(b, h, n, 2, d).permute(3, 0, 2, 1, 4))
        if self._stream is not None:  # the WRITE reads the area right after: the copy must be done
            self._stream.synchronize()


class AuxRows:
    """Our source rows of the aux WRITE: ``[rows, wire fields]`` bytes on the pool's device (so one
    NIXL registration covers it), a free list of row slots."""

    FIELDS = wire.WRITTEN

    def __init__(self, device: torch.device, rows: int = 256):
        self._offsets, off = {}, 0
        for f in self.FIELDS:
            self._offsets[f] = off
            off += f.row_bytes
        self.row_bytes = off
        self.tensor = torch.zeros(rows, off, dtype=torch.uint8, device=device)
        self._free = list(range(rows - 1, -1, -1))
        self._lock = threading.Lock()

    def alloc(self) -> int:
        with self._lock:
            return self._free.pop() if self._free else -1

    def free(self, slot: int) -> None:
        with self._lock:
            if slot >= 0 and slot not in self._free:
                self._free.append(slot)

    def fill(self, slot: int, room: int, token: int, logprobs: Sequence[tuple[int, float]] | None,
             cached_tokens: int) -> list[wire.AuxField]:
        """Write one request's rows into ``slot``; returns the fields to send (logprob rows only
        when the engine computed them)."""
        row = np.zeros(self.row_bytes, dtype=np.uint8)

        def put(f: wire.AuxField, values: Sequence) -> None:
            a = np.asarray(values, dtype=f.dtype)[: f.width]
            row[self._offsets[f]:self._offsets[f] + a.nbytes] = a.view(np.uint8)

        put(wire.OUTPUT_IDS, [token])
        put(wire.CACHED_TOKENS, [cached_tokens, cached_tokens])
        put(wire.BOOTSTRAP_ROOM, [room])
        fields = [wire.OUTPUT_IDS, wire.CACHED_TOKENS, wire.BOOTSTRAP_ROOM]
        if logprobs:
            (tok, lp), top = logprobs[0], list(logprobs[1:])[: wire.MAX_TOP_LOGPROBS]
            put(wire.LOGPROB_VAL, [lp])
            put(wire.LOGPROB_IDX, [tok])
            put(wire.TOP_LOGPROBS_VAL, [v for _, v in top])
            put(wire.TOP_LOGPROBS_IDX, [i for i, _ in top])
            fields += [wire.LOGPROB_VAL, wire.LOGPROB_IDX, wire.TOP_LOGPROBS_VAL, wire.TOP_LOGPROBS_IDX]
        self.tensor[slot].copy_(torch.from_numpy(row))
        return fields

    def descs(self, slot: int, fields: list[wire.AuxField], dest: Destination) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) descriptors: each field's row to its buffer's row ``aux_index`` (DRAM there)."""
        base = self.tensor[slot].data_ptr()
        dev = device_id_of(self.tensor)
        peer, i = dest.peer, dest.info.aux_index
        src = [(base + self._offsets[f], f.row_bytes, dev) for f in fields]
        dst = [(peer.reg.aux_ptrs[peer.aux[f]] + f.row_bytes * i, f.row_bytes, 0) for f in fields]
        return np.array(src, dtype=np.uint64), np.array(dst, dtype=np.uint64)


class SGLangTarget:
    """The writer's ``LayerTarget`` for SGLang rooms (``p.dest``). ``in_flight(p, layer)``: polls
    whether a WRITE of p's layer is still in flight (takes the producer's lock)."""

    def __init__(self, pool: KVPages, g: Geometry, area: ConvertArea,
                 in_flight: Callable[[PushRequest, int], bool], timeout_s: float):
        self.pool, self.g, self.area = pool, g, area
        self._in_flight, self.timeout_s = in_flight, timeout_s

    def remote_mem_type(self, p: SGLangRequest) -> str:
        assert p.dest is not None
        return p.dest.peer.reg.kv_mem_kind

    def notif(self, p: SGLangRequest, layer: int) -> bytes:
        return b""  # 0.5.23 completes with KV_STATUS over ZMQ, not NIXL notifications

    def layer_descs(self, p: SGLangRequest, layer: int, src_pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        dest = p.dest
        assert dest is not None
        slot = layer % self.area.slots
        self.area.claim(slot, p, layer, self._in_flight, self.timeout_s)
        pages, skip = self._pages(p, dest, src_pages)
        self.area.convert(slot, pages)
        dev, ptrs, n = device_id_of(self.pool.kv), dest.peer.reg.kv_ptrs, self.g.num_layers
        off = dest.src_off + skip * self.g.row_bytes  # (row 0 of the area: the first block's first token)
        src = np.concatenate([self.area.base(slot, 0) + off, self.area.base(slot, 1) + off])
        dst = np.concatenate([ptrs[layer] + dest.dst_off, ptrs[n + layer] + dest.dst_off])
        ln = np.concatenate([dest.length, dest.length])
        return (np.stack([src, ln, np.full_like(ln, dev)], axis=1).astype(np.uint64),
                np.stack([dst, ln, np.full_like(ln, dest.peer.dst_dev)], axis=1).astype(np.uint64))

    def _pages(self, p: SGLangRequest, dest: Destination, src_pages: Sequence[int]):
        """(the flat pool pages holding the tokens sent: a slice if consecutive, else an index on
        the pool's device; tokens of the first page not sent); once per staging page list."""
        cached = p.descs.get(id(src_pages))
        if cached is None or cached[0] is not src_pages:
            n = self.pool.block_size
            first, last = dest.first_token // n, -(-(dest.first_token + dest.num_rows) // n)
            pages = list(src_pages[first:last])
            if pages == list(range(pages[0], pages[0] + len(pages))):
                index = slice(pages[0], pages[0] + len(pages))
            else:
                index = torch.as_tensor(pages, dtype=torch.long, device=self.pool.kv.device)
            cached = p.descs[id(src_pages)] = (src_pages, (index, dest.first_token - first * n))
        return cached[1]

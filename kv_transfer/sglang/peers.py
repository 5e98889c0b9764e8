"""What an SGLang decode may ask of us, checked once: its registration against our KV geometry
(``Peer``, kept in a bounded ``PeerTable``), and a room's transfer info against its request
(``destination``: the coalesced runs its layers are written in). A refusal is a reason string the
decode gets back in its failed KV_STATUS, so it says what to change."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kv_transfer.sglang import v0_5_23 as wire


@dataclass(frozen=True)
class Geometry:
    """Our side of the bytes: the KV a decode must hold to take ours."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int  # bytes of one element (our pool's dtype; the decode's must be the same)
    page_size: int  # the decode's --page-size (advertised; SGLang refuses another)

    @property
    def row_bytes(self) -> int:  # one token of one layer's K (or V): [kv_heads, head_dim]
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def item_len(self) -> int:  # one page of one buffer
        return self.page_size * self.row_bytes


@dataclass(frozen=True)
class Peer:
    """A registered decode rank: usable (``refusal`` empty, ``remote`` its loaded NIXL agent) or not."""

    reg: wire.Registration
    remote: str = ""
    aux: dict | None = None  # wire.AuxField -> buffer index
    refusal: str = ""

    @property
    def dst_dev(self) -> int:
        return self.reg.gpu_id if self.reg.kv_mem_kind == "VRAM" else 0


def registration_refusal(reg: wire.Registration, g: Geometry) -> str:
    """Why we cannot write into this decode rank's KV, or ""."""
    if reg.tp_size != 1 or reg.dcp_size != 1:
        return (f"this prefill serves decodes with attention TP 1 and DCP 1; the decode has TP "
                f"{reg.tp_size}, DCP {reg.dcp_size}")
    if reg.has_state:
        return "the decode's model has extra state pools (hybrid/SWA): this prefill serves plain MHA only"
    if len(reg.kv_ptrs) != 2 * g.num_layers:
        return (f"the decode registered {len(reg.kv_ptrs)} KV buffers; our {g.num_layers}-layer model needs "
                f"{2 * g.num_layers} (K and V per layer): is it serving the same model?")
    if set(reg.kv_item_lens) != {g.item_len}:
        return (f"the decode's KV pages are {sorted(set(reg.kv_item_lens))[:3]} bytes, ours {g.item_len} "
                f"({g.page_size} tokens x {g.num_kv_heads} heads x {g.head_dim} x {g.itemsize} bytes): run both "
                "with the same --page-size and KV dtype")
    if reg.num_slots and reg.num_slots < 2:
        return f"the decode's KV buffers hold {reg.num_slots} page(s)"
    if wire.aux_layout(len(reg.aux_ptrs)) is None:
        return (f"the decode has {len(reg.aux_ptrs)} metadata buffers; this prefill knows SGLang "
                f"{wire.VERSION}'s layouts with {sorted(wire.AUX_LAYOUTS)} (no speculative decoding)")
    return ""


class PeerTable:
    """Decode ranks by NIXL agent name; the oldest beyond ``max_peers`` is forgotten (``forget``
    unloads its NIXL metadata). Used under the producer's lock."""

    def __init__(self, forget: Callable[[str], None], max_peers: int = 1024):
        self._peers: OrderedDict[str, Peer] = OrderedDict()
        self._forget, self.max_peers = forget, max_peers

    def add(self, reg: wire.Registration, g: Geometry, load: Callable[[str, bytes], str]) -> Peer:
        """Check and keep ``reg``; ``load(name, metadata)`` loads a usable peer's NIXL metadata."""
        old = self._peers.pop(reg.agent_name, None)
        if old is not None and old.remote and old.reg.agent_metadata != reg.agent_metadata:
            self._forget(old.remote)
        peer = Peer(reg, refusal=registration_refusal(reg, g))
        if not peer.refusal:
            try:
                peer = Peer(reg, remote=load(reg.agent_name, reg.agent_metadata), aux=wire.aux_layout(len(reg.aux_ptrs)))
            except Exception as e:  # noqa: BLE001 - bad metadata refuses the peer, never the service
                peer = Peer(reg, refusal=f"could not load the decode's NIXL metadata: {type(e).__name__}: {e}")
        self._peers[reg.agent_name] = peer
        while len(self._peers) > self.max_peers:
            _, gone = self._peers.popitem(last=False)
            if gone.remote:
                self._forget(gone.remote)
        return peer

    def get(self, agent_name: str) -> Peer | None:
        return self._peers.get(agent_name)

    def clear(self) -> None:
        self._peers.clear()


@dataclass(frozen=True, eq=False)
class Destination:
    """One room's pages on its decode, as coalesced runs: K rows [src_off, src_off + length) of our
    converted layer (token-major ``[tokens, heads, head_dim]``) go to ``ptr + dst_off`` of that
    layer's K buffer, and the same runs for V. Runs depend on the pages only, not on the layer."""

    peer: Peer
    info: wire.TransferInfo
    first_token: int  # prompt tokens [first_token, num_tokens) are sent (the decode has the rest)
    num_rows: int  # num_tokens - first_token
    src_off: np.ndarray  # int64 [R]
    dst_off: np.ndarray  # int64 [R]
    length: np.ndarray  # int64 [R]

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.info.endpoint, self.info.port


def destination(peer: Peer | None, info: wire.TransferInfo, num_tokens: int, g: Geometry) -> Destination | str:
    """The runs that write ``num_tokens`` prompt tokens into ``info``'s pages, or why not."""
    if peer is None:
        return (f"decode agent {info.agent_name} never registered with this prefill (it restarted, or "
                "the registration was refused as malformed): restart the decode's KV manager")
    if peer.refusal:
        return peer.refusal
    if info.room == 0:
        return "bootstrap_room 0 can never complete on an SGLang decode: use a room in 1..2^63-1"
    if info.required_dst_info_num != 1 or info.is_dummy or info.has_state:
        return (f"transfer info wants {info.required_dst_info_num} decode ranks per room (dummy "
                f"{info.is_dummy}, state {info.has_state}): this prefill serves equal-TP MHA decodes only")
    ps, prefix = g.page_size, info.prefix_len
    if prefix % ps or prefix > num_tokens:
        return f"decode prefix of {prefix} tokens: not page-aligned or longer than the prompt ({num_tokens})"
    rows = num_tokens - prefix
    need = -(-rows // ps)
    if len(info.pages) != need:  # SGLang sends the pages of its prompt past its prefix, no more
        return (f"the decode sent {len(info.pages)} pages (page size {ps}) for its prompt past its {prefix}-token "
                f"prefix, where this prompt of {num_tokens} tokens needs {need}: the decode's prompt is not the one "
                "prefilled here (its tokenizer or chat template differ from this server's for this request; "
                "--tokenizer-parity decode tokenizes every request at the decode)")
    pages = info.pages[:need].astype(np.int64)
    slots = peer.reg.num_slots or (1 << 62)
    if need and (int(pages.min()) < 1 or int(pages.max()) >= slots):
        return f"page indices outside the decode's KV buffers (1..{slots - 1}; page 0 is padding)"
    # runs of consecutive pages: one descriptor each (per layer, for K and for V)
    starts = np.flatnonzero(np.concatenate(([True], pages[1:] != pages[:-1] + 1))) if need else np.zeros(0, np.int64)
    ends = np.concatenate((starts[1:], [need])).astype(np.int64) if need else starts
    row0 = starts * ps
    nrows = np.minimum(ends * ps, rows) - row0
    return Destination(peer, info, prefix, rows, src_off=row0 * g.row_bytes, dst_off=pages[starts] * g.item_len,
                       length=nrows * g.row_bytes)

"""SGLang 0.5.23's PD-disaggregation wire with its NIXL transfer backend, as a prefill must speak it
(read from sglang 0.5.23's ``srt/disaggregation/{common,nixl}/conn.py``, ``utils.py``, ``environ.py``).
Everything version-specific lives in this module: a second SGLang version is one more module.

One request (room R: a random 63-bit int the router puts in both the prefill's and the decode's
request, with our ``bootstrap_host``/``bootstrap_port``)::

    decode --GET /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1-->
           bootstrap server: PrefillServerInfo JSON (page size, KV dtype, TP/CP/DP/PP sizes)
    decode --GET /route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0-->
           {"rank_ip", "rank_port"}: our ZMQ PULL socket
    decode ==PUSH [NixlMsgGuard, "None", ip, port, agent, NIXL metadata, KV/aux pointers, ...]==>
           (25 frames, once per decode rank: ``Registration``)
    decode ==PUSH [NixlMsgGuard, R, ip, port, agent, page indices (int32), aux index, ...]==>
           (11 frames, per request: ``TransferInfo``)
    prefill ==NIXL WRITE: K and V of every layer into those pages, then the aux rows (first token,
           room)==> decode;  prefill ==PUSH [KV_STATUS, R, "4" | "0", rank, reason]==> decode's PULL
    decode ==PUSH [ABORT, R, ip, port, generation]==> prefill; the prefill answers
           [ABORT_ACK, R, rank, generation] once none of its WRITEs to R is in flight
    decode --GET /health every 5 s--> bootstrap server (2 misses: the prefill is dead, its rooms fail)

The decode's KV (MHA, ``MHATokenToKVPool.get_contiguous_buf_infos``): one buffer per layer for K,
then one per layer for V, each ``[(pages + 1) * page_size, kv_heads, head_dim]`` (NHD; page 0 is
padding, never allocated); page p of a buffer is ``item_len`` bytes at ``ptr + p * item_len``.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgspec
import numpy as np

VERSION = "0.5.23"

GUARD = b"NixlMsgGuard"
ABORT = b"ABORT"
ABORT_ACK = b"ABORT_ACK"
KV_STATUS = b"KV_STATUS"
REGISTRATION_FRAMES = 25  # with the guard
TRANSFER_INFO_FRAMES = 11
# tags on the decode -> prefill socket that belong to features we do not serve (heterogeneous-TP
# staging, the "prefill_complete" allocation policy): ignored, as a prefill without them does
IGNORED_TAGS = (b"WATERMARK", b"STAGING_RSP", b"BOOTSTRAP")

# environ.py defaults (SGLANG_DISAGGREGATION_*): both sides time a request out after these
BOOTSTRAP_TIMEOUT_S = 300.0  # prefill: no transfer info for a room
WAITING_TIMEOUT_S = 300.0  # decode: no KV_STATUS after its transfer info
HEARTBEAT_INTERVAL_S = 5.0  # decode: GET /health
HEARTBEAT_MAX_FAILURES = 2
ABORT_RELEASE_TIMEOUT_S = 30.0  # decode: an aborted room's pages wait this long for ABORT_ACK

MAX_ROOM = 2**63 - 1
PREFILL_RANK = 0  # our one rank: attn TP 1, CP 1, PP 1, DP 1


class KVPoll(IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


class MalformedMessage(ValueError):
    """A decode message we cannot use; the text says which frame and why (for the log)."""


# ---------------------------------------------------------------- decode -> prefill messages
@dataclass(frozen=True)
class Registration:
    """A decode rank's one-time registration (``KVArgsRegisterInfo``)."""

    endpoint: str  # its PULL socket, for KV_STATUS / ABORT_ACK
    port: int
    agent_name: str
    agent_metadata: bytes
    kv_ptrs: tuple[int, ...]  # K buffers of layers 0..L-1, then V buffers (MHA)
    kv_mem_kind: str  # "VRAM" | "DRAM" (one kind for all)
    kv_item_lens: tuple[int, ...]  # bytes of one page, per buffer
    num_slots: int  # pages per buffer
    aux_ptrs: tuple[int, ...]  # one per metadata buffer (``aux_layout``)
    gpu_id: int
    tp_size: int
    tp_rank: int
    dcp_size: int
    has_state: bool  # hybrid models' extra state pools (not served)


@dataclass(frozen=True, eq=False)
class TransferInfo:
    """Where one room's KV goes (``TransferInfo``): the decode's pages for prompt tokens
    [prefix_len, prompt length), in order, and its metadata-buffer row."""

    room: int
    endpoint: str
    port: int
    agent_name: str
    pages: np.ndarray  # int32 page indices
    aux_index: int
    required_dst_info_num: int  # decode ranks that each send one (1 at equal TP)
    has_state: bool
    prefix_len: int  # tokens the decode already holds (its radix cache); page-aligned
    is_dummy: bool


@dataclass(frozen=True)
class Abort:
    """The decode gave the room up; with a return address and generation it waits for ABORT_ACK."""

    room: int
    endpoint: str | None = None
    port: int | None = None
    generation: int | None = None


Message = Registration | TransferInfo | Abort

_HOST = re.compile(rb"[A-Za-z0-9.:\-_\[\]%]{1,255}")
_NAME = re.compile(rb"[\x21-\x7e]{1,256}")
MAX_METADATA_BYTES = 64 << 20
MAX_BUFFERS = 1 << 16


def _int(frame: bytes, what: str, lo: int, hi: int) -> int:
    if not isinstance(frame, bytes) or not 0 < len(frame) <= 20 or not frame.lstrip(b"-").isdigit():
        raise MalformedMessage(f"{what}: not a decimal integer ({frame[:24]!r})")
    v = int(frame)
    if not lo <= v <= hi:
        raise MalformedMessage(f"{what}: {v} outside [{lo}, {hi}]")
    return v


def _text(frame: bytes, what: str, pattern: re.Pattern) -> str:
    if not pattern.fullmatch(frame):
        raise MalformedMessage(f"{what}: not a usable name ({frame[:24]!r})")
    return frame.decode("ascii")


def _words(frame: bytes, what: str, fmt: str, max_n: int = MAX_BUFFERS) -> tuple[int, ...]:
    width = struct.calcsize(fmt)
    if len(frame) % width or len(frame) // width > max_n:
        raise MalformedMessage(f"{what}: {len(frame)} bytes is not a list of {width}-byte words")
    return struct.unpack(f"<{len(frame) // width}{fmt}", frame)


def _packed_lists_present(frame: bytes, what: str) -> bool:
    """``pack_int_lists`` frames (state pointers/indices): True if any list is non-empty."""
    if frame == b"":
        return False
    if len(frame) < 4:
        raise MalformedMessage(f"{what}: truncated list header")
    (n,) = struct.unpack("<I", frame[:4])
    if n > MAX_BUFFERS or len(frame) < 4 + 4 * n:
        raise MalformedMessage(f"{what}: bad list header")
    lens = struct.unpack(f"<{n}I", frame[4:4 + 4 * n])
    if 4 + 4 * n + sum(lens) != len(frame):
        raise MalformedMessage(f"{what}: list lengths do not add up")
    return any(lens)


def parse(frames: list[bytes]) -> Message:
    """One multipart message from a decode, validated; ``MalformedMessage`` says why not. Never
    raises anything else, whatever the frames hold."""
    try:
        if not frames or not all(isinstance(f, bytes) for f in frames):
            raise MalformedMessage("empty message")
        if frames[0] == ABORT:
            return _abort(frames)
        if frames[0] != GUARD:
            raise MalformedMessage(f"unknown message tag {frames[0][:24]!r}")
        if len(frames) > 1 and frames[1] == b"None":
            return _registration(frames)
        return _transfer_info(frames)
    except MalformedMessage:
        raise
    except Exception as e:  # noqa: BLE001 - junk from the network is never an internal error
        raise MalformedMessage(f"{type(e).__name__}: {e}") from None


def _registration(f: list[bytes]) -> Registration:
    if len(f) != REGISTRATION_FRAMES:
        raise MalformedMessage(f"registration has {len(f)} frames, SGLang {VERSION} sends {REGISTRATION_FRAMES}")
    f = f[1:]
    kv_ptrs = _words(f[5], "KV pointers", "Q")
    if not kv_ptrs or not all(kv_ptrs):
        raise MalformedMessage("KV pointers: none, or a null one")
    kinds = f[17].decode("ascii", errors="replace").split(",") if f[17] else ["VRAM"] * len(kv_ptrs)
    if len(kinds) != len(kv_ptrs) or len(set(kinds)) != 1 or kinds[0] not in ("VRAM", "DRAM"):
        raise MalformedMessage(f"KV memory kinds {sorted(set(kinds))[:4]} (want one of VRAM, DRAM per buffer)")
    item_len = _int(f[11], "KV item length", 1, 1 << 40)
    item_lens = _words(f[18], "KV item lengths", "Q") if f[18] else (item_len,) * len(kv_ptrs)
    if len(item_lens) != len(kv_ptrs):
        raise MalformedMessage(f"{len(item_lens)} KV item lengths for {len(kv_ptrs)} buffers")
    aux_ptrs = _words(f[6], "aux pointers", "Q", 64)
    if not aux_ptrs or not all(aux_ptrs):
        raise MalformedMessage("aux pointers: none, or a null one")
    if len(f[4]) > MAX_METADATA_BYTES or not f[4]:
        raise MalformedMessage(f"NIXL metadata of {len(f[4])} bytes")
    tp_size = _int(f[9], "decode TP size", 1, 4096)
    return Registration(
        endpoint=_text(f[1], "endpoint", _HOST), port=_int(f[2], "port", 1, 65535),
        agent_name=_text(f[3], "agent name", _NAME), agent_metadata=f[4], kv_ptrs=kv_ptrs,
        kv_mem_kind=kinds[0], kv_item_lens=item_lens,
        num_slots=_int(f[16], "KV slots", 0, 1 << 40) if f[16] else 0, aux_ptrs=aux_ptrs,
        gpu_id=_int(f[8], "gpu id", 0, 1 << 16), tp_size=tp_size, tp_rank=_int(f[10], "decode TP rank", 0, tp_size - 1),
        dcp_size=_int(f[21], "DCP size", 1, 4096) if f[21] else 1,
        has_state=_packed_lists_present(f[7], "state pointers"))


def _transfer_info(f: list[bytes]) -> TransferInfo:
    if len(f) != TRANSFER_INFO_FRAMES:
        raise MalformedMessage(f"transfer info has {len(f)} frames, SGLang {VERSION} sends {TRANSFER_INFO_FRAMES}")
    f = f[1:]
    if len(f[4]) % 4 or len(f[4]) > 4 * (1 << 26):
        raise MalformedMessage(f"page indices: {len(f[4])} bytes is not a list of int32")
    pages = np.frombuffer(f[4], dtype="<i4").astype(np.int32)
    if pages.size and int(pages.min()) < 0:
        raise MalformedMessage("page indices: a negative page")
    return TransferInfo(
        room=_int(f[0], "room", 0, MAX_ROOM), endpoint=_text(f[1], "endpoint", _HOST),
        port=_int(f[2], "port", 1, 65535), agent_name=_text(f[3], "agent name", _NAME), pages=pages,
        aux_index=_int(f[5], "aux index", 0, 1 << 31), required_dst_info_num=_int(f[6], "required infos", 1, 4096),
        has_state=_packed_lists_present(f[7], "state indices"),
        prefix_len=_int(f[8], "decode prefix length", 0, 1 << 40) if f[8] else 0,
        is_dummy=bool(_int(f[9], "dummy flag", 0, 1)) if f[9] else False)


def _abort(f: list[bytes]) -> Abort:
    if not 2 <= len(f) <= 5:
        raise MalformedMessage(f"ABORT has {len(f)} frames")
    room = _int(f[1], "room", 0, MAX_ROOM)
    if len(f) < 4:
        return Abort(room)
    try:  # SGLang keeps the room when the return address is bad; so do we
        endpoint, port = _text(f[2], "endpoint", _HOST), _int(f[3], "port", 1, 65535)
    except MalformedMessage:
        return Abort(room)
    gen = None
    if len(f) == 5:
        try:
            gen = _int(f[4], "generation", 0, 1 << 62)
        except MalformedMessage:
            pass
    return Abort(room, endpoint, port, gen)


# ---------------------------------------------------------------- prefill -> decode messages
def kv_status(room: int, ok: bool, reason: str = "") -> list[bytes]:
    """The terminal status of a room (0.5.23: tagged, with a reason; up to 0.5.22 NIXL notifications)."""
    state = KVPoll.SUCCESS if ok else KVPoll.FAILED
    return [KV_STATUS, str(room).encode(), str(int(state)).encode(), str(PREFILL_RANK).encode(),
            ("" if ok else reason).encode("utf-8", errors="replace")[:2000]]


def abort_ack(room: int, generation: int) -> list[bytes]:
    return [ABORT_ACK, str(room).encode(), str(PREFILL_RANK).encode(), str(generation).encode()]


# ---------------------------------------------------------------- the bootstrap server's JSON
class RankInfo(msgspec.Struct, kw_only=True):
    """``PUT /route``: one prefill rank's registration (what SGLang's ``register_to_bootstrap``
    sends; extra keys are ignored as SGLang's server ignores them)."""

    attn_tp_size: int
    attn_tp_rank: int
    attn_cp_size: int
    attn_cp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    pp_size: int
    pp_rank: int
    system_dp_size: int
    system_dp_rank: int
    rank_ip: str
    rank_port: int
    page_size: int
    kv_cache_dtype: str | None = None
    kv_layout: str | None = None
    load_balance_method: str = "follow_bootstrap_room"
    enable_dsa_cache_layer_split: bool = False
    enable_kv_cache_sharding: bool = False
    prefill_http_port: int | None = None
    decode_allocation_policy: str = "early"

    def check(self) -> str | None:
        """Why this registration makes no sense, or None."""
        sizes = (self.attn_tp_size, self.attn_cp_size, self.attn_dp_size, self.pp_size, self.system_dp_size)
        ranks = (self.attn_tp_rank, self.attn_cp_rank, self.attn_dp_rank, self.pp_rank, self.system_dp_rank)
        if not all(1 <= s <= 4096 for s in sizes) or not all(0 <= r < s for r, s in zip(ranks, sizes)):
            return "sizes must be 1..4096 and each rank below its size"
        if not 1 <= self.rank_port <= 65535 or not _HOST.fullmatch(self.rank_ip.encode()):
            return "rank_ip/rank_port are not an address"
        if not 1 <= self.page_size <= 1 << 20:
            return "page_size must be positive"
        return None

    @property
    def dp_group(self) -> int:
        return self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank

    @property
    def dp_size(self) -> int:
        return self.attn_dp_size if self.system_dp_size == 1 else self.system_dp_size


def our_rank(rank_ip: str, rank_port: int, page_size: int, kv_cache_dtype: str | None,
             prefill_http_port: int | None) -> RankInfo:
    """Our one rank (attn TP/CP/DP/PP 1), as SGLang's prefill would register it."""
    return RankInfo(attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1,
                    attn_dp_rank=0, pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0,
                    rank_ip=rank_ip, rank_port=rank_port, page_size=page_size, kv_cache_dtype=kv_cache_dtype,
                    prefill_http_port=prefill_http_port)


ROUTE_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


def server_info(first: RankInfo) -> dict[str, Any]:
    """``GET /route?...=-1``: ``PrefillServerInfo`` as ``dataclasses.asdict`` gives it, minus
    ``dsv41_spec_layout`` and ``kv_layout`` when None. The decode builds the dataclass with
    ``PrefillServerInfo(**json)``: any other key fails every request, so this list is exact."""
    info: dict[str, Any] = {
        "attn_tp_size": first.attn_tp_size, "attn_cp_size": first.attn_cp_size, "dp_size": first.dp_size,
        "pp_size": first.pp_size, "page_size": first.page_size, "kv_cache_dtype": first.kv_cache_dtype,
        "follow_bootstrap_room": first.load_balance_method == "follow_bootstrap_room",
        "enable_dsa_cache_layer_split": first.enable_dsa_cache_layer_split,
    }
    if first.kv_layout is not None:
        info["kv_layout"] = first.kv_layout
    info.update({
        "decode_allocation_policy": first.decode_allocation_policy,
        "enable_kv_cache_sharding": first.enable_kv_cache_sharding,
        "prefill_http_port": first.prefill_http_port,
        "target_tp_rank": None, "target_tp_ranks": None, "target_cp_ranks": None, "target_pp_ranks": None,
        "required_dst_info_num": None, "required_prefill_response_num": None,
    })
    return info


# ---------------------------------------------------------------- the metadata ("aux") buffers
@dataclass(frozen=True)
class AuxField:
    name: str
    dtype: str  # numpy dtype of one row
    width: int  # elements per row

    @property
    def row_bytes(self) -> int:
        return np.dtype(self.dtype).itemsize * self.width


# ``MetadataBuffers.get_buf_infos`` order with the default options (no sampling mask, no DSA top-k,
# no KV checksum; 16 float32 hidden-state slots when no speculative draft). Rows are indexed by the
# transfer info's aux index; the decode sends only pointers, so the row sizes are these.
OUTPUT_IDS = AuxField("output_ids", "<i4", 16)  # [0]: the first token
CACHED_TOKENS = AuxField("cached_tokens", "<i4", 16)  # [0] cached, [1] device, [2] host, [3] storage
LOGPROB_VAL = AuxField("output_token_logprobs_val", "<f4", 16)  # [0]: the first token's logprob
LOGPROB_IDX = AuxField("output_token_logprobs_idx", "<i4", 16)
TOP_LOGPROBS_VAL = AuxField("output_top_logprobs_val", "<f4", 128)  # [:top_logprobs_num]
TOP_LOGPROBS_IDX = AuxField("output_top_logprobs_idx", "<i4", 128)
BOOTSTRAP_ROOM = AuxField("bootstrap_room", "<u8", 8)  # [0]: the room; 0 = not written yet
MAX_TOP_LOGPROBS = TOP_LOGPROBS_VAL.width
WRITTEN = (OUTPUT_IDS, CACHED_TOKENS, LOGPROB_VAL, LOGPROB_IDX, TOP_LOGPROBS_VAL, TOP_LOGPROBS_IDX, BOOTSTRAP_ROOM)

# buffer count -> index of each field we write. 10: the default; +1 at the end: KV checksum (a
# zero row means "no digest", which the decode skips); +3 after the top logprobs: sampling mask.
_BASE = {OUTPUT_IDS: 0, CACHED_TOKENS: 1, LOGPROB_VAL: 2, LOGPROB_IDX: 3, TOP_LOGPROBS_VAL: 4, TOP_LOGPROBS_IDX: 5}
AUX_LAYOUTS: dict[int, dict[AuxField, int]] = {
    10: {**_BASE, BOOTSTRAP_ROOM: 9}, 11: {**_BASE, BOOTSTRAP_ROOM: 9},
    13: {**_BASE, BOOTSTRAP_ROOM: 12}, 14: {**_BASE, BOOTSTRAP_ROOM: 12},
}


def aux_layout(num_buffers: int) -> dict[AuxField, int] | None:
    """Where our fields are among a decode's ``num_buffers`` metadata buffers; None if unknown
    (a speculative-decoding or DSA decode, or another SGLang version)."""
    return AUX_LAYOUTS.get(num_buffers)

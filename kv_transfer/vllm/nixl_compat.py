"""Impersonate a stock vLLM ``NixlConnector`` producer (pull mode): the side channel that answers a
decode's handshake with our NIXL metadata, the leases of published blocks, and the notifications
that end them. The wire facts are ``kv_transfer.vllm.nixl_wire``'s; each decode's vLLM version
brings its own ``NixlWire`` (``DecodeInfo.wire``: hash factors, params), so one producer serves
decodes of every version we speak (``kv_transfer.vllm.nixl_versions``) at once.

Freeing: blocks are leased on ``publish``; the lease ends on the decode's ``"{rid}:{n}"`` (after n
of them), on ``abort``, or on expiry (default 30 s like vLLM; each heartbeat extends it to at least
``now + lease_ttl_s``). One service thread owns the ZMQ sockets and the NIXL agent: it sleeps in a
ZMQ poll (``poll_interval_s`` = 2 ms while leases are held, ``idle_poll_interval_s`` otherwise; no
busy spin), answers handshakes, drains NIXL notifications (which also drives UCX progress when
NIXL's own progress thread is off: the default for a CPU pool, since that thread spins a core) and
expires leases every ``expiry_interval_s``.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kv_transfer.base import KVPages, LeaseProducer, ProducerStats, Route, StatsCounter, TransferState, check_request_id
from kv_transfer.nixl import NixlAgent
from kv_transfer.router_socket import RouterSocket
from kv_transfer.vllm.discovery import CPU_BACKEND
from kv_transfer.vllm.nixl_decode import DecodeInfo
from kv_transfer.vllm.nixl_wire import (DEFAULT_LEASE_TTL_S, GET_META_MSG, PLAIN_PAGE_BACKEND, NixlHandshakePayload,
                                        build_agent_metadata, compatibility_hash)
from prefill_server.errors import InvalidRequest

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    num_tokens: int
    nbytes: int
    channel: _Channel
    handshakes_at_publish: int  # the channel's count then: tells an unread lease's likely cause
    notified: int = 0


@dataclass
class _Channel:
    """One side-channel socket: decodes sharing a compatibility hash share one port (and so one
    vLLM version: the hash carries it)."""

    decode: DecodeInfo
    host: str
    port: int
    payload: bytes = b""
    router: RouterSocket | None = field(default=None, repr=False)
    handshakes: int = 0  # answered on this channel

    def describe(self) -> str:
        d = self.decode
        return (f"side channel {self.host}:{self.port} (decodes of vLLM {d.vllm_version} with --model "
                f"{d.model!r} and attention backend {d.attn_backend_name})")


class NixlCompatProducer(LeaseProducer):
    """The pull-mode producer a stock vLLM NixlConnector decode reads from (any version of
    ``nixl_versions``; each decode's ``DecodeInfo.wire`` says which).

    ``decode``: the decode(s) this producer serves; decodes whose compatibility hashes differ (a
    0.32 and a 0.33 decode always do) get one side-channel port each (the handshake request does
    not say who asks). ``host`` is the address advertised to decodes (``remote_host``),
    ``bind_host`` the one bound (default: host), ``port`` the first side-channel port (0 = any
    free port).

    ``engine_id``: a decode caches the NIXL agent it loaded for an engine id. Without one, each
    ``start()`` takes a fresh id. With a fixed one, ``start()`` after ``stop()`` registers the pool
    again (a new agent) under the same id, so ``registration_generation`` rises by one on every
    ``start()`` (1 after the first, as a vLLM prefill publishes) and ``publish`` hands it to
    0.33+ decodes as ``remote_registration_generation``: a decode that saw a lower one drops the
    stale agent and handshakes again. A 0.32 decode has no such field: keep ``engine_id`` unset
    behind 0.32 decodes if the producer may restart."""

    routes = frozenset({Route.LEASE})

    def __init__(self, pool: KVPages, decode: DecodeInfo | Sequence[DecodeInfo], *,
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
        self.registration_generation = 0  # rises with every registration of the pool (start())
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
            self.registration_generation += 1
            meta = build_agent_metadata(self.pool, self.engine_id, self._agent.metadata(),
                                        self.advertised_backend)
            meta_bytes = msgspec.msgpack.encode(meta)
            for h, ch in self._channels.items():
                ch.payload = msgspec.msgpack.encode(NixlHandshakePayload(h, meta_bytes))
                ch.router = RouterSocket(self.bind_host, ch.port)
                ch.port = ch.router.port
        except Exception:
            self._close_transport()
            raise
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="kv-producer-vllm-nixl", daemon=True)
        self._started = True
        self._thread.start()
        log.info("vLLM NIXL producer %s (registration %d) serving side channel(s) %s", self.engine_id,
                 self.registration_generation,
                 [f"{c.host}:{c.port} (vLLM {c.decode.vllm_version})" for c in self._channels.values()])

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
            if ch.router is not None:
                ch.router.close()
                ch.router = None
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    @property
    def side_channel_ports(self) -> list[int]:
        return [c.port for c in self._channels.values()]

    # ---- engine API ----
    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int, *,
                decode_url: str | None = None, cached_tokens: int = 0) -> dict[str, Any]:
        """Lease ``block_ids`` (the KV of ``num_tokens`` prompt tokens, and any room the engine
        left past them) and return the ``kv_transfer_params`` that offer them all to a decode,
        in the form its vLLM version reads (``decode_url``'s; default: the first decode's).
        The decode allocates blocks for its whole prompt and asserts that the prefill offers as
        many: fit the params to the prompt it is sent with ``nixl_wire.params_for_prompt``."""
        if not self._started:
            raise RuntimeError("NixlCompatProducer.publish before start()")
        check_request_id(request_id)
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
            self._entries[request_id] = _Entry(num_tokens, nbytes, ch, ch.handshakes)
            self._finished.pop(request_id, None)
            self._stats.add(published_total=1, bytes_offered_total=nbytes)
            self._stats.set(active_leases=len(self._entries))
        return ch.decode.wire.producer_params(
            engine_id=self.engine_id, request_id=request_id, block_ids=blocks, host=ch.host, port=ch.port,
            num_tokens=num_tokens, cached_tokens=cached_tokens,
            registration_generation=self.registration_generation)

    def abort(self, request_id: str, reason: str = "", on_idle: Callable[[], None] | None = None) -> bool:
        ended = self._end(request_id, TransferState.ABORTED)
        if on_idle is not None:  # (the decode READs; nothing of ours is in flight)
            on_idle()
        return ended

    # context-manager sugar for tests and scripts
    def __enter__(self) -> NixlCompatProducer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

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
            log.warning("KV lease of request %s expired before a decode read it: %s", rid, _unread_cause(entry))
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
            ended = self._finished.get(rid)
            if entry is None:
                late = True
            else:
                late = False
                entry.notified += 1
                done = entry.notified >= int(n_text)
        if late:
            self._stats.add(bad_notifications_total=1)
            if ended is TransferState.ABORTED:  # released here first (the decode refused it, or its client left)
                log.debug("NIXL notification for request %s, whose KV was released here already", rid)
            else:
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
            poller.register(ch.router.sock, zmq.POLLIN)
            socks[ch.router.sock] = ch
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
        if (got := ch.router.recv_request()) is None:
            return
        identity, body = got
        try:
            msg, pp_rank, tp_rank = msgspec.msgpack.decode(body)
            ok = msg == GET_META_MSG and pp_rank == 0 and tp_rank == 0
        except (msgspec.DecodeError, ValueError, TypeError, RecursionError):  # (deep nesting: the last)
            ok = False
        if not ok:
            # A REQ peer waits for an answer: give it an empty one it will fail to decode loudly.
            log.warning("side channel: unexpected request %r (only get_meta_msg for pp 0, tp 0)", body[:64])
            ch.router.reply(identity, b"", msgspec.msgpack.encode(time.perf_counter()))
            return
        self._stats.add(handshakes_total=1)
        ch.handshakes += 1
        ch.router.reply(identity, ch.payload, msgspec.msgpack.encode(time.perf_counter()))


def _unread_cause(e: _Entry) -> str:
    """The likely reason no decode read a lease, for the log (a decode caches our agent after its
    first handshake, so a read needs no new one)."""
    ch = e.channel
    if ch.handshakes > e.handshakes_at_publish:
        return (f"a decode handshook on the {ch.describe()} meanwhile and read nothing: if its log says "
                "'compatibility hash mismatch', it differs from those (start this server with its "
                "--decode-vllm-version, --decode-model, --decode-attn-backend and --dtype, or give --decode-url)")
    return (f"no decode asked the {ch.describe()} meanwhile: the request's kv_transfer_params were not sent to a "
            "decode (client or router gone), or the decode failed before reading (its log says why), or it "
            "cannot reach that address (--side-channel-host)")

"""Streaming push producer (connector mode): the prefill WRITEs each layer's KV into the decode's
own blocks as soon as that layer is computed. The decode side is ``kv_transfer.vllm.connector``;
the messages are ``kv_transfer.wire``.

Per request (``TransferState``)::

    engine.submit(push request) -> expect(rid, n)              EXPECTING
    decode connector --Register (HMAC)--> side channel         READY   (Ack accepted)
    engine forward, layer l: K/V into staging pages -> layer_done(rid, l, pages, event): queued
    poster thread: wait for the event (the layer's K/V are in the pages) -> NIXL WRITE pages ->
        decode blocks, notification "psv1 done rid l"          SENDING
    engine: wait_layer(rid, l - slots) before reusing a staging slot (layer posted, then WRITE DONE)
    engine: finish(rid): every layer posted, every WRITE DONE  RELEASED
    any time: abort (gateway / engine), Cancel from the decode, a WRITE error, no Register within
    ``register_timeout_s``: ABORTED / FAILED / EXPIRED; the decode gets "psv1 fail rid reason"
    whenever it registered and did not get all layers (after an abort: once no WRITE is in flight).

Posting happens on the producer's poster thread, never on the caller's: ``layer_done`` only
queues ``(request, layer, pages, event)``, so the forward's thread never waits for the GPU and the
GPU's queue does not drain at a layer boundary (the poster waits on the event and posts while the
next layers compute). ``async_post=False`` posts on the caller's thread instead (the behaviour
before; kept for the benchmark's comparison).

Ownership: staging pages belong to the engine (it frees them once ``finish`` returns, or when
``abort`` calls its ``on_idle``); this producer never frees pool blocks. It guarantees that once
``finish`` returns, once ``abort``'s ``on_idle`` runs and once a Cancel is acknowledged, none of
the request's WRITEs is still in flight (or, past ``transfer_timeout_s``, they were given up), so
neither side's blocks can be overwritten after they are reused. ``abort`` itself waits at most
``abort_wait_s`` (a fraction of a second): WRITEs still in flight then are left to the service
thread, which ends the request once they are done, or gives them up ``transfer_timeout_s`` after
the abort, and calls ``on_idle`` then. A decode that dies with a WRITE in flight thus never stalls
the engine that aborts the request.

Nothing waits on a request that is going away: ``wait_layer`` and ``finish`` raise at once when
the request was aborted, cancelled by its decode or failed, or when the caller's ``stop()`` says so
(the engine's abort of a forward waiting on a WRITE), leaving any WRITE still in flight to
``abort``'s ``on_idle``; a raising ``finish`` or ``wait_layer`` thus means "call ``abort`` and free
the staging pages in its ``on_idle``", never "free them now". A decode's Cancel is acknowledged
by the service thread once the request's WRITEs are over, without waiting on that thread: it goes
on serving other decodes meanwhile.

Pull fallback: a Register with ``transfer_mode="pull"`` makes the request an ordinary prefill
(``wants_pull``); the engine then hands its blocks to ``publish`` and ``kv_transfer.pull.PullLeases``
(sharing this side channel and NIXL agent) leases them until the decode has READ them.
Computed first (``hold``): the engine computes a request before any decode knows of it (the
gateway wants the first token before it calls the decode) and leases its blocks; the decode's
Register, asking pull for the same number of tokens, comes later and is served from the lease as
above (``PullLeases.attach``). Such a request never waits for a Register, so the register timeout
does not apply: the lease's deadline bounds it.
Page layouts: the decode names its own and gives its strides; ``kv_transfer.layout`` builds the
descriptors for it.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from kv_transfer import layout, wire
from kv_transfer.base import ProducerStats, StatsCounter, TransferMode, TransferState
from kv_transfer.nixl import NixlAgent, device_id_of, mem_type_of
from kv_transfer.pull import PullLeases
from prefill_server.engine.kv_pool import KVPool
from prefill_server.errors import InvalidRequest, RequestCancelled, TransferError

log = logging.getLogger(__name__)

PARAMS_KEY = "prefill_server"  # kv_transfer_params[PARAMS_KEY] marks a request for our connector


def coalesced_descs(src_addr: np.ndarray, dst_addr: np.ndarray, page_bytes: int, src_dev: int,
                    dst_dev: int) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 (addr, len, dev) descriptor pairs for page i: src_addr[i] -> dst_addr[i], one
    descriptor per run of pages contiguous on BOTH sides (few large transfers instead of many
    page-sized ones)."""
    return layout.descs(src_addr, dst_addr, np.array([[0, 0, page_bytes]], dtype=np.int64), src_dev, dst_dev)


@dataclass
class _Push:
    request_id: str
    num_tokens: int
    state: TransferState = TransferState.EXPECTING
    reg: wire.Register | None = None
    remote: str = ""  # the decode's NIXL agent name
    handles: dict[int, Any] = field(default_factory=dict)  # layer -> in-flight WRITE
    layers_written: set[int] = field(default_factory=set)
    error: str = ""
    created: float = field(default_factory=time.monotonic)
    layer_times: list[tuple[int, float, float]] = field(default_factory=list)  # (layer, posted, done)
    ready: threading.Event = field(default_factory=threading.Event)
    unposted: set[int] = field(default_factory=set)  # layers queued for the poster, not yet handled
    closing: bool = False  # abort/cancel under way: nothing more is posted
    descs: dict[int, tuple] = field(default_factory=dict)  # id(src_pages) -> (src_pages, src, dst - layer base)
    abort_reason: str = ""  # aborted: ends (ABORTED) once no WRITE is in flight (see PushProducer.abort)
    aborted_at: float = 0.0
    on_idle: list[Callable[[], None]] = field(default_factory=list)  # abort's callbacks, run once it ends
    cancel_acks: list[tuple[bytes, bytes]] = field(default_factory=list)  # (identity, nonce): Acks owed (no WRITE in flight)


class PushProducer:
    """Prefill side of connector mode. ``geometry`` is our pool's (``wire.Geometry``), ``secret``
    the shared HMAC key; ``host``/``port`` the side channel advertised to (and bound for)
    decodes. ``async_post``: post each layer's WRITE on the producer's poster thread (default) or
    on the caller's (the behaviour before; the benchmark compares the two).
    ``transfer_timeout_s`` bounds every wait for a WRITE (the server keeps it within the lease
    time); ``abort_wait_s`` is the most ``abort`` itself waits for one (then: the service thread)."""

    mode = TransferMode.PUSH

    def __init__(self, pool: KVPool, geometry: wire.Geometry, secret: bytes, *,
                 host: str = "127.0.0.1", port: int = 0, bind_host: str | None = None,
                 register_timeout_s: float = 60.0, transfer_timeout_s: float = 60.0,
                 poll_interval_s: float = 0.002, keep_finished: int = 4096, async_post: bool = True,
                 lease_ttl_s: float = 30.0, abort_wait_s: float = 0.25):
        if len(secret) < 16:
            raise ValueError("the connector secret must have at least 16 bytes")
        if not transfer_timeout_s > 0 or not abort_wait_s >= 0:
            raise ValueError(f"transfer_timeout_s must be positive (got {transfer_timeout_s}) and "
                             f"abort_wait_s >= 0 (got {abort_wait_s})")
        self.pool, self.geometry, self.secret = pool, geometry, secret
        self.host, self.bind_host, self.port = host, bind_host or host, port
        self.register_timeout_s, self.transfer_timeout_s = register_timeout_s, transfer_timeout_s
        self.poll_interval_s = poll_interval_s
        self.abort_wait_s = min(abort_wait_s, transfer_timeout_s)
        self.async_post = async_post
        self.engine_id = f"prefill-push-{uuid.uuid4()}"
        self._lock = threading.RLock()  # guards _reqs, _finished, _jobs and every NIXL agent call
        self._posted_cv = threading.Condition(self._lock)  # notified: a job queued, handled or dropped
        self._jobs: deque[tuple[_Push, int, Sequence[int], Any]] = deque()  # for the poster thread
        self._poster: threading.Thread | None = None
        self._reqs: dict[str, _Push] = {}
        self._finished: OrderedDict[str, TransferState] = OrderedDict()
        self._due: list[Callable[[], None]] = []  # ended requests' on_idle callbacks, not run yet
        self._acks_due: list[tuple[bytes, wire.Ack]] = []  # Cancel Acks now due (the service thread sends them)
        self._keep_finished = keep_finished
        self._remotes: dict[str, bytes] = {}  # agent name -> metadata we loaded
        self._replay = wire.ReplayGuard()
        self._stats = StatsCounter()
        self.pull = PullLeases(pool, lease_ttl_s, self._stats, self._ended)  # (pull fallback)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._agent: NixlAgent | None = None
        self._zmq: Any = None
        self._sock: Any = None
        self._started = False
        self.refused_total = 0
        # request id -> [(layer, WRITE posted, WRITE seen done)] (monotonic s), last 256 requests
        self.last_layer_times: OrderedDict[str, list[tuple[int, float, float]]] = OrderedDict()

    # ---- lifecycle ----
    def start(self) -> None:
        if self._started:
            return
        self._agent = NixlAgent(self.engine_id, progress_thread=False)
        try:
            self._agent.register(self.pool.kv)
            self._zmq = zmq.Context()
            self._sock = self._zmq.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
            if ":" in self.bind_host:
                self._sock.setsockopt(zmq.IPV6, 1)
            if self.port:
                self._sock.bind(f"tcp://{host}:{self.port}")
            else:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        except Exception:
            self._close()
            raise
        self._stop.clear()
        self._started = True
        self._thread = threading.Thread(target=self._serve, name="kv-producer-push", daemon=True)
        self._thread.start()
        self._poster = threading.Thread(target=self._post_loop, name="kv-producer-post", daemon=True)
        self._poster.start()
        log.info("push producer %s: side channel %s:%d", self.engine_id, self.host, self.port)

    def stop(self) -> None:
        if not self._started:
            return
        for rid in list(self._reqs):
            self.abort(rid)
        while True:  # aborts with WRITEs in flight end here (done, or given up at their timeout)
            with self._lock:
                self._reap()
                left = any(p.abort_reason for p in self._reqs.values())
                due = self._take_due()
            self._run_callbacks(due)
            if not left:
                break
            time.sleep(0.005)
        with self._lock:
            self.pull.stop()  # leases still held end here
            self._stop.set()
            self._posted_cv.notify_all()
        for t in (self._thread, self._poster):
            if t is not None:
                t.join(timeout=10)
        self._thread = self._poster = None
        self._close()
        self._started = False

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    # ---- engine API ----
    def expect(self, request_id: str, num_tokens: int) -> dict[str, Any]:
        """Announce a request whose decode will register; returns the ``kv_transfer_params`` the
        decode request must carry."""
        self._check_new("expect", request_id)
        with self._lock:
            self._refuse_taken(request_id)
            self._reqs[request_id] = _Push(request_id, num_tokens)
            self._finished.pop(request_id, None)
        return self._params(request_id, num_tokens)

    def is_ready(self, request_id: str) -> bool:
        with self._lock:
            p = self._reqs.get(request_id)
            return p is not None and p.state is TransferState.READY

    def wants_pull(self, request_id: str) -> bool:
        """The decode registered asking for the pull fallback: compute the prompt whole, then
        ``publish`` its blocks."""
        with self._lock:
            p = self._reqs.get(request_id)
            return p is not None and p.reg is not None and p.reg.transfer_mode == "pull"

    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> None:
        """Pull fallback: ``block_ids`` hold the prompt's KV; lease them to the decode and tell it.
        Raises (leasing nothing; the caller still owns the blocks) if that cannot be done."""
        with self._lock:
            p = self._reqs.get(request_id)
            if p is None or p.state is not TransferState.READY or not self.wants_pull(request_id):
                raise TransferError(p.error if p is not None and p.error else
                                    f"request {request_id} is not waiting for its decode to pull")
            self.pull.publish(request_id, p.remote, list(block_ids), num_tokens, self._send_notif)
            self._reqs.pop(request_id)

    def hold(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> dict[str, Any]:
        """Computed first: ``block_ids`` hold the prompt's KV; lease them for a decode that
        registers later, asking pull for ``num_tokens`` tokens. Returns the ``kv_transfer_params``
        the decode request must carry. Raises (leasing nothing; the caller still owns the blocks)
        if the request id is taken."""
        self._check_new("hold", request_id)
        with self._lock:
            self._refuse_taken(request_id)
            self.pull.hold(request_id, list(block_ids), num_tokens)
            self._finished.pop(request_id, None)
        return self._params(request_id, num_tokens, transfer_mode="pull")

    def _check_new(self, method: str, request_id: str) -> None:
        if not self._started:
            raise RuntimeError(f"PushProducer.{method} before start()")
        if not request_id or " " in request_id or len(request_id) > 200:
            raise InvalidRequest("request id must be 1-200 characters without spaces", field="request_id")

    def _refuse_taken(self, request_id: str) -> None:  # lock held
        if request_id in self._reqs or request_id in self.pull:
            raise InvalidRequest(f"request {request_id} is already in use here", field="request_id")

    def _params(self, request_id: str, num_tokens: int, **extra: Any) -> dict[str, Any]:
        """The ``kv_transfer_params`` that send a decode's connector here for ``request_id``."""
        return {PARAMS_KEY: {"version": wire.PROTOCOL_VERSION, "request_id": request_id,
                             "host": self.host, "port": self.port, "num_tokens": num_tokens, **extra}}

    def wait_ready(self, request_id: str, timeout_s: float) -> bool:
        with self._lock:
            p = self._reqs.get(request_id)
        return p is not None and p.ready.wait(timeout_s) and self.is_ready(request_id)

    def overdue(self, request_id: str, now: float | None = None) -> str | None:
        """Why a request still waiting for its decode must fail now, else None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            p = self._reqs.get(request_id)
            if p is None:
                return f"request {request_id} is not expected (aborted?)"
            if p.state.is_terminal:
                return p.error or f"transfer {p.state.value}"
            if p.state is TransferState.EXPECTING and now - p.created > self.register_timeout_s:
                return (f"no decode registered for request {request_id} within "
                        f"{self.register_timeout_s:.0f} s: is the decode running our connector?")
        return None

    def layer_done(self, request_id: str, layer: int, src_pages: Sequence[int],
                   ready_event: Any = None) -> None:
        """Layer ``layer`` of the whole prompt sits in pool pages ``src_pages`` (flat indices into
        ``pool.kv.view(L * NB, ...)``; page i holds tokens [i*N, (i+1)*N)). Start its WRITE once
        ``ready_event`` (a CUDA event the K/V writes recorded; None: ready now) has completed.
        Returns at once: the poster thread waits for the event and posts (``async_post``). Keep
        ``src_pages`` unchanged until ``finish``/``abort``: its descriptors are built once per
        request and list object."""
        if not self.async_post:
            with self._lock:
                p = self._reqs.get(request_id)
            if p is not None:
                self._post_layer(p, layer, src_pages, ready_event)
            return
        with self._lock:
            p = self._reqs.get(request_id)
            if p is None or p.closing or p.state not in (TransferState.READY, TransferState.SENDING):
                return  # aborted or failed meanwhile: the engine finds out in wait_layer/finish
            if not self._poster or not self._poster.is_alive():
                raise RuntimeError("PushProducer.layer_done: the poster thread is not running (stopped?)")
            p.unposted.add(layer)
            self._jobs.append((p, layer, src_pages, ready_event))
            self._posted_cv.notify_all()

    def _post_loop(self) -> None:
        """The poster thread: for each queued layer, wait for its event, build and post its WRITE."""
        while True:
            with self._lock:
                while not self._jobs and not self._stop.is_set():
                    self._posted_cv.wait()
                if not self._jobs:
                    return
                p, layer, src_pages, event = self._jobs.popleft()
            try:
                self._post_layer(p, layer, src_pages, event)
            except Exception as e:  # noqa: BLE001 - the request fails; the engine sees it in wait_layer/finish
                log.exception("posting layer %d of %s failed", layer, p.request_id)
                with self._lock:
                    self._fail(p, f"WRITE of layer {layer} could not start: {type(e).__name__}: {e}", keep=True)
            finally:
                with self._lock:
                    p.unposted.discard(layer)
                    self._posted_cv.notify_all()

    def _post_layer(self, p: _Push, layer: int, src_pages: Sequence[int], ready_event: Any) -> None:
        with self._lock:
            if p.closing or p.state not in (TransferState.READY, TransferState.SENDING):
                return
            reg = p.reg
        assert reg is not None
        if ready_event is not None:
            ready_event.synchronize()
        src, dst = self._layer_descs(p, reg, layer, src_pages)
        t = time.monotonic()
        with self._lock:
            if p.closing or p.state.is_terminal:
                return  # an abort/cancel/failure came meanwhile: it waits for the WRITEs in p.handles only
            try:
                assert self._agent is not None
                h = self._agent.post("WRITE", src, dst, p.remote,
                                     mem_type_of(self.pool.kv), reg.mem_type,
                                     notif=wire.done_notif(p.request_id, layer))
            except Exception as e:  # noqa: BLE001
                self._fail(p, f"WRITE of layer {layer} could not start: {e}", keep=True)
                return
            p.handles[layer] = h
            p.state = TransferState.SENDING
            p.layer_times.append((layer, t, 0.0))
        self._stats.add(bytes_offered_total=int(src[:, 1].sum()))

    def _layer_descs(self, p: _Push, reg: wire.Register, layer: int,
                     src_pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Coalesced (src, dst) descriptors of one layer, per the decode's page layout
        (``kv_transfer.layout``). The runs depend only on the pages and the decode's block ids and
        strides, not on the layer: built once per request and staging slot (the page
        list object), then each layer only adds its base address on the decode."""
        cached = p.descs.get(id(src_pages))
        if cached is None or cached[0] is not src_pages:
            first = reg.first_token // self.geometry.block_size
            last = self.pool.blocks_needed(reg.num_tokens)
            src_addr = (self.pool.kv.data_ptr()
                        + np.asarray(src_pages[first:last], dtype=np.int64) * self.geometry.page_bytes)
            dst_off = np.asarray(reg.block_ids[first:last], dtype=np.int64) * reg.block_stride
            g = reg.geometry  # (its page layout and strides were checked at registration)
            chunks = layout.page_chunks(layout.of_wire(g.page_layout, reg.layer_addrs, reg.block_stride,
                                                       reg.head_stride, reg.token_stride, g))
            src, dst_rel = layout.descs(src_addr, dst_off, chunks, device_id_of(self.pool.kv), reg.device_id)
            cached = p.descs[id(src_pages)] = (src_pages, src, dst_rel)
        dst = cached[2].copy()
        dst[:, 0] += np.uint64(reg.layer_addrs[layer])
        return cached[1], dst

    def _wait_posted(self, request_id: str, pending, timeout_s: float | None = None,
                     stop: Callable[[], bool] | None = None) -> None:
        """Block until ``pending(p)`` is false: the poster has handled those layers. A request gone
        or going away meanwhile returns at once (``_wait`` raises then); past the timeout the
        request fails (nothing more is posted)."""
        limit = timeout_s or self.transfer_timeout_s
        deadline = time.monotonic() + limit
        with self._lock:
            while True:
                p = self._reqs.get(request_id)
                if p is None or not pending(p) or p.closing or p.state.is_terminal or (stop and stop()):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    p.closing = True
                    self._drop_jobs(p)
                    self._fail(p, f"layers {sorted(p.unposted)} not posted within {limit:.0f} s "
                                  "(their K/V never became ready?)", keep=True)
                    return
                self._posted_cv.wait(min(left, 0.05) if stop else left)

    def _drop_jobs(self, p: _Push) -> None:
        """(lock held) Remove the request's queued layers (the one being posted, if any, stays:
        it checks ``closing`` under the lock before posting)."""
        kept = deque(j for j in self._jobs if j[0] is not p)
        for j in self._jobs:
            if j[0] is p:
                p.unposted.discard(j[1])
        self._jobs = kept
        self._posted_cv.notify_all()

    def wait_layer(self, request_id: str, layer: int, stop: Callable[[], bool] | None = None) -> None:
        """Block until layer ``layer`` is posted and its WRITE is done (staging slot reuse).
        Raises at once (TransferError / RequestCancelled) if the request fails, is aborted or
        cancelled, or ``stop()`` turns true meanwhile: then ``abort`` it (a WRITE may still be in
        flight; its ``on_idle`` says when the staging pages are free)."""
        self._wait_posted(request_id, lambda p: layer in p.unposted, stop=stop)
        self._wait(request_id, lambda p: [layer] if layer in p.handles else [], stop=stop)

    def finish(self, request_id: str, timeout_s: float | None = None,
               stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Wait for every WRITE of the request; RELEASED (no WRITE in flight). Raises
        TransferError / RequestCancelled at once if the transfer failed, was aborted or cancelled,
        or ``stop()`` turns true: then ``abort`` it and free the staging pages in its ``on_idle``."""
        self._wait_posted(request_id, lambda p: bool(p.unposted), timeout_s, stop=stop)
        self._wait(request_id, lambda p: list(p.handles), timeout_s, stop=stop)
        with self._lock:
            p = self._reqs.get(request_id)
            if p is None:
                raise RequestCancelled(f"request {request_id} was aborted")
            if p.state.is_terminal:
                raise TransferError(p.error or f"transfer {p.state.value}")
            missing = p.reg.geometry.num_layers - len(p.layers_written) if p.reg else -1
            if missing:
                self._fail(p, f"{missing} layer(s) were never written")
                raise TransferError(p.error)
            self._end(p, TransferState.RELEASED)
            times = list(p.layer_times)
            self.last_layer_times[request_id] = times
            while len(self.last_layer_times) > 256:
                self.last_layer_times.popitem(last=False)
        self._stats.add(released_total=1)
        return {"layer_times": times}

    def abort(self, request_id: str, reason: str = "aborted by the prefill server",
              on_idle: Callable[[], None] | None = None) -> bool:
        """Stop the request: drop its queued layers (nothing more is posted); once none of its
        WRITEs is in flight, tell a registered decode it failed, end it (ABORTED) and call
        ``on_idle`` (where the caller frees the staging pages). Waits at most ``abort_wait_s``
        for in-flight WRITEs (ending it within that, it calls ``on_idle`` before returning); past
        that the service thread ends the request once they are done, or gives them up
        ``transfer_timeout_s`` after the abort, and calls ``on_idle`` then. ``on_idle`` runs
        exactly once and never under this producer's lock; at once when the request is unknown
        (returns False) or a pull lease."""
        with self._lock:
            p = None if (leased := self.pull.abort(request_id, reason, self._send_notif)) \
                else self._reqs.get(request_id)
            if p is not None:
                p.closing = True
                self._drop_jobs(p)
                if not p.abort_reason:
                    p.abort_reason, p.aborted_at = reason or "aborted", p.aborted_at or time.monotonic()
                    self._stats.add(aborted_total=1)
                if on_idle is not None:
                    p.on_idle.append(on_idle)
        if p is None:
            self._run_callbacks([on_idle] if on_idle is not None else [])
            return leased
        deadline = time.monotonic() + self.abort_wait_s
        delay = 0.0002
        while True:
            with self._lock:  # (the service thread leaves it alone until abort_wait_s has passed)
                ended = self._reqs.get(request_id) is not p or self._try_end(p)
                due = self._take_due()
            self._run_callbacks(due)
            if ended or time.monotonic() >= deadline:
                return True
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def state(self, request_id: str) -> TransferState | None:
        with self._lock:
            p = self._reqs.get(request_id)
            if p is not None:
                return p.state
            return TransferState.LEASED if request_id in self.pull else self._finished.get(request_id)

    def stats(self) -> ProducerStats:
        s = self._stats.snapshot()
        with self._lock:
            s.active_leases = len(self._reqs) + len(self.pull)
        return s

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._reqs) + len(self.pull)

    # ---- internals ----
    def _wait(self, request_id: str, which, timeout_s: float | None = None,
              stop: Callable[[], bool] | None = None) -> None:
        """Wait until none of the WRITEs ``which(p)`` names is in flight. Raises at once, without
        waiting for them, when the request failed, is going away or ``stop()`` holds (its abort
        waits for them); past the timeout they are given up and the request fails."""
        limit = timeout_s or self.transfer_timeout_s
        deadline = time.monotonic() + limit
        delay = 0.0002
        while True:
            with self._lock:
                p = self._reqs.get(request_id)
                if p is None:
                    raise RequestCancelled(f"request {request_id} was aborted")
                self._poll_handles(p, which(p))
                if p.state.is_terminal and p.state is not TransferState.RELEASED:
                    raise TransferError(p.error or f"transfer {p.state.value}")
                if p.closing or (stop is not None and stop()):
                    raise RequestCancelled(f"request {request_id} was aborted")
                if not [layer for layer in which(p) if layer in p.handles]:
                    return
                if time.monotonic() >= deadline:
                    self._give_up(p, limit)
                    raise TransferError(p.error)
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def _poll_handles(self, p: _Push, layers) -> None:
        """(lock held) Check the WRITEs of ``layers`` still in flight; release the finished ones
        (DONE: the layer is written; an error state fails the request)."""
        for layer in [x for x in layers if x in p.handles]:
            state = self._agent.poll(p.handles[layer])
            if state == "PROC":
                continue
            self._agent.release(p.handles.pop(layer))
            lt = [x for x in p.layer_times if x[0] == layer]
            if lt:
                p.layer_times[p.layer_times.index(lt[-1])] = (layer, lt[-1][1], time.monotonic())
            if state == "DONE":
                p.layers_written.add(layer)
            else:
                self._fail(p, f"WRITE of layer {layer} failed: {state}", keep=True)

    def _give_up(self, p: _Push, limit: float) -> None:
        """(lock held) WRITEs still in flight after ``limit`` seconds: fail the request (the decode
        is told) and release their handles."""
        self._fail(p, f"WRITEs still in flight after {limit:g} s (decode gone?)", keep=True)
        for h in p.handles.values():
            self._agent.release(h)
        p.handles.clear()

    def _writes_over(self, p: _Push) -> bool:
        """(lock held) An aborted or cancelled request: True once none of its WRITEs is in flight
        (those still in flight ``transfer_timeout_s`` after the abort/Cancel are given up)."""
        self._poll_handles(p, list(p.handles))
        if p.handles and time.monotonic() < p.aborted_at + self.transfer_timeout_s:
            return False
        if p.handles:
            self._give_up(p, self.transfer_timeout_s)
        return True

    def _try_end(self, p: _Push) -> bool:
        """(lock held) An aborted request: once its WRITEs are over, end it (ABORTED; the decode
        is told; its ``on_idle`` callbacks become due). False while WRITEs are still in flight."""
        if not self._writes_over(p):
            return False
        self._fail(p, p.abort_reason or p.error or "cancelled", TransferState.ABORTED)  # (no handle left: it ends)
        return True

    def _reap(self) -> None:
        """(lock held; the service thread) ``_try_end`` the aborted requests whose ``abort`` has
        stopped waiting (``abort_wait_s``): their WRITEs were still in flight then; and the ones
        a decode cancelled, whose Ack waits for their WRITEs."""
        now = time.monotonic()
        for p in [q for q in self._reqs.values() if q.cancel_acks]:
            self._release_acks(p)
        for p in [q for q in self._reqs.values() if q.abort_reason and now >= q.aborted_at + self.abort_wait_s]:
            self._try_end(p)

    def _release_acks(self, p: _Push) -> None:
        """(lock held) A cancelled request: once its WRITEs are over, its Acks are due (the service
        thread sends them). The entry stays, ABORTED, for the engine to see (its finish/abort ends it)."""
        if self._writes_over(p):
            self._owe_acks(p)

    def _owe_acks(self, p: _Push) -> None:
        """(lock held) ``p``'s Cancel Acks are due now."""
        self._acks_due += [(identity, wire.Ack(version=wire.PROTOCOL_VERSION, request_id=p.request_id,
                                               accepted=True, nonce=nonce)) for identity, nonce in p.cancel_acks]
        p.cancel_acks = []

    def _take_due(self) -> list[Callable[[], None]]:
        """(lock held) The due ``on_idle`` callbacks, for the caller to run once it has let go of the lock."""
        due, self._due = self._due, []
        return due

    @staticmethod
    def _run_callbacks(callbacks: list[Callable[[], None]]) -> None:
        for cb in callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001 - one failing callback never stops the service thread
                log.exception("an abort's on_idle callback failed")

    def _fail(self, p: _Push, reason: str, state: TransferState = TransferState.FAILED,
              keep: bool = False) -> None:
        """(lock held) Terminal failure; notify a registered decode. ``keep``: leave the entry so the
        engine's finish/abort can still see the error (it ends the entry)."""
        if not p.state.is_terminal:
            p.error = p.error or reason
            if p.remote and self._agent is not None:
                try:
                    self._agent.send_notif(p.remote, wire.fail_notif(p.request_id, reason))
                except Exception:  # noqa: BLE001
                    log.warning("could not tell decode %s that %s failed", p.remote, p.request_id)
            log.warning("push of %s failed: %s", p.request_id, reason)
            p.state = state
            p.ready.set()
        if not keep and not p.handles:
            self._end(p, p.state)

    def _end(self, p: _Push, state: TransferState) -> None:
        p.state = state
        self._reqs.pop(p.request_id, None)
        self._due += p.on_idle  # (an abort's callbacks, however the entry ends)
        p.on_idle = []
        self._owe_acks(p)  # (a Cancel's; however the entry ends)
        self._ended(p.request_id, state)

    def _ended(self, request_id: str, state: TransferState) -> None:
        self._finished[request_id] = state
        while len(self._finished) > self._keep_finished:
            self._finished.popitem(last=False)

    def _send_notif(self, remote: str, msg: bytes) -> None:  # (lock held)
        assert self._agent is not None
        self._agent.send_notif(remote, msg)

    # ---- side channel ----
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            due: list[Callable[[], None]] = []
            try:
                for _ in poller.poll(int(self.poll_interval_s * 1000) or 1):
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    if len(frames) == 3 and frames[1] == b"":  # from a REQ socket
                        self._answer(frames[0], frames[2])
                    else:
                        log.warning("side channel: ignored a %d-frame message", len(frames))
                with self._lock:
                    if self._agent is not None:
                        for agent, msg in self._agent.get_notifs():  # (also drives UCX progress)
                            self.pull.on_notif(agent, msg)  # a pull READ is over
                        self.pull.expire(self._send_notif)
                        self._progress_writes()
                        self._reap()  # aborted requests whose WRITEs are over (or given up)
                        due = self._take_due()
                    acks, self._acks_due = self._acks_due, []
                for identity, ack in acks:  # Cancels whose WRITEs are over
                    self._reply(identity, ack)
            except Exception:  # noqa: BLE001 - one bad message never stops the service
                log.exception("push side channel error")
                self._stop.wait(0.05)
            self._run_callbacks(due)

    def _progress_writes(self) -> None:
        """(lock held) Check the state of every in-flight WRITE (releasing none: ``_wait`` and
        ``_try_end`` do).
        NIXL moves a transfer on, and sends its notification, only when its state is checked:
        checked only by ``wait_layer`` (two layers later) and ``finish``, a 128K layer's WRITE
        reached the decode ~106 ms after it was posted on an H200 (nixl-cu13 1.5.1, cuda_ipc;
        the copy itself takes 0.5 ms), and 2 ms after when checked every millisecond."""
        for p in self._reqs.values():
            for h in p.handles.values():
                self._agent.poll(h)

    def _reply(self, identity: bytes, ack: wire.Ack) -> None:
        self._sock.send_multipart((identity, b"", wire.encode(wire.sign(self.secret, ack))))

    def _refuse(self, identity: bytes, request_id: str, nonce: bytes, error: str, signed: bool) -> None:
        self.refused_total += 1
        ack = wire.Ack(version=wire.PROTOCOL_VERSION, request_id=request_id, accepted=False,
                       error=error, nonce=nonce)
        if signed:
            self._reply(identity, ack)
        else:  # a stranger: an unsigned refusal and nothing else
            self._sock.send_multipart((identity, b"", wire.encode(ack)))

    def _answer(self, identity: bytes, body: bytes) -> None:
        try:
            msg = wire.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._refuse(identity, "", b"", f"malformed message: {e}", signed=False)
            return
        if msg.version != wire.PROTOCOL_VERSION:  # first: another version's MAC would not match
            self._refuse(identity, "", b"", f"protocol version {msg.version} not supported (this server "
                         f"speaks {wire.PROTOCOL_VERSION}); upgrade the side that is behind", signed=False)
            return
        if isinstance(msg, (wire.Ack, wire.Offer)) or not wire.verify(self.secret, msg):
            log.warning("side channel: refused a message that failed authentication")
            self._refuse(identity, "", b"", "authentication failed", signed=False)
            return
        if why := self._replay.check(msg.nonce, msg.timestamp):
            self._refuse(identity, msg.request_id, msg.nonce, why, signed=True)
            return
        if isinstance(msg, wire.Cancel):
            self._cancel(identity, msg)
        elif isinstance(msg, wire.Fetch):
            self._fetch(identity, msg)
        else:
            self._register(identity, msg)

    def _fetch(self, identity: bytes, msg: wire.Fetch) -> None:
        with self._lock:
            offer = self.pull.offer(msg, self.engine_id, self._agent.metadata())
        if isinstance(offer, str):
            return self._refuse(identity, msg.request_id, msg.nonce, offer, signed=True)
        self._sock.send_multipart((identity, b"", wire.encode(wire.sign(self.secret, offer))))

    def _cancel(self, identity: bytes, msg: wire.Cancel) -> None:
        """(the service thread) The decode gives the request up: nothing more is posted, the
        request is ABORTED, and the Ack is sent once none of its WRITEs is in flight (given up
        ``transfer_timeout_s`` after the Cancel): at once in the usual case; meanwhile this thread
        goes on serving (``_reap`` sends it). The engine's forward stops at its next
        ``wait_layer``/``finish``, which raise; its abort ends the entry."""
        with self._lock:
            if self.pull.cancel(msg.request_id):  # leased: the decode has no READ in flight
                p = None
            elif (p := self._reqs.get(msg.request_id)) is not None:
                p.closing = True
                self._drop_jobs(p)
                if not p.state.is_terminal:
                    p.error = "cancelled by the decode"
                    p.state = TransferState.ABORTED
                    p.ready.set()
                p.aborted_at = p.aborted_at or time.monotonic()  # (the give-up deadline counts from here)
                p.cancel_acks.append((identity, msg.nonce))
                self._release_acks(p)
                acks, self._acks_due = self._acks_due, []
                due = self._take_due()
        if p is None:
            return self._reply(identity, wire.Ack(version=wire.PROTOCOL_VERSION, request_id=msg.request_id,
                                                  accepted=True, nonce=msg.nonce))
        for ident, ack in acks:
            self._reply(ident, ack)
        self._run_callbacks(due)

    def _register(self, identity: bytes, reg: wire.Register) -> None:
        def refuse(error: str) -> None:
            self._refuse(identity, reg.request_id, reg.nonce, error, signed=True)

        if diffs := self.geometry.mismatches(reg.geometry):
            return refuse("incompatible KV layout: " + "; ".join(diffs))
        g = reg.geometry
        needed = self.pool.blocks_needed(reg.num_tokens)
        if len(reg.layer_addrs) != g.num_layers:
            return refuse(f"{len(reg.layer_addrs)} layer addresses for {g.num_layers} layers")
        if len(reg.block_ids) < needed or not 0 <= reg.first_token < reg.num_tokens:
            return refuse(f"{reg.num_tokens} tokens need {needed} destination blocks, got "
                          f"{len(reg.block_ids)} (first token {reg.first_token})")
        try:
            layout.of_wire(g.page_layout, reg.layer_addrs, reg.block_stride, reg.head_stride, reg.token_stride, g)
        except ValueError as e:
            return refuse(f"bad destination: {e}")
        if reg.mem_type not in ("DRAM", "VRAM") or reg.transfer_mode not in wire.TRANSFER_MODES:
            return refuse(f"bad destination: memory type {reg.mem_type!r}, transfer mode {reg.transfer_mode!r}")
        if reg.transfer_mode == "pull" and needed > self.pool.num_blocks:
            why = (f"pull mode needs the whole prompt's KV resident: {needed} blocks, the prefill's pool "
                   f"has {self.pool.num_blocks}; use push (the default) for this prompt")
            with self._lock:  # the engine fails the request at once
                if (p := self._reqs.get(reg.request_id)) is not None and p.state is TransferState.EXPECTING:
                    self._fail(p, why, keep=True)
            return refuse(why)
        with self._lock:
            if self.pull.is_unattached(reg.request_id):
                if why := self._register_held(reg):
                    return refuse(why)
            else:
                p = self._reqs.get(reg.request_id)
                if p is None or p.state is not TransferState.EXPECTING:
                    return refuse(f"request {reg.request_id} is not waiting for a decode here "
                                  "(unknown, finished or already registered)")
                if reg.num_tokens != p.num_tokens:
                    return refuse(f"the decode has {reg.num_tokens} prompt tokens, the prefill "
                                  f"{p.num_tokens}: send the decode the same token ids")
                try:
                    p.remote = self._load_remote(reg)
                except Exception as e:  # noqa: BLE001
                    return refuse(f"could not load the decode's NIXL metadata: {e}")
                p.reg, p.state = reg, TransferState.READY
                p.ready.set()
        self._stats.add(handshakes_total=1)
        self._reply(identity, wire.Ack(version=wire.PROTOCOL_VERSION, request_id=reg.request_id,
                                       accepted=True, nonce=reg.nonce, write_timeout_s=self.transfer_timeout_s))

    def _register_held(self, reg: wire.Register) -> str | None:
        """(lock held) A Register for a request computed first (``hold``): attach the decode to its
        lease, which sends it the "ready" notification. Why not, or None. A refused decode leaves
        the lease as it was: its deadline (or an abort) frees it."""
        if why := self.pull.attach_refusal(reg.request_id, reg.transfer_mode, reg.num_tokens):
            return why
        try:
            remote = self._load_remote(reg)
        except Exception as e:  # noqa: BLE001
            return f"could not load the decode's NIXL metadata: {e}"
        return self.pull.attach(reg.request_id, remote, self._send_notif)

    def _load_remote(self, reg: wire.Register) -> str:
        """(lock held) The decode's NIXL agent name, its metadata loaded (reloaded if it changed)."""
        if self._remotes.get(reg.agent_name) == reg.agent_metadata:
            return reg.agent_name
        if reg.agent_name in self._remotes:
            self._agent.remove_remote(reg.agent_name)
        remote = self._agent.add_remote(reg.agent_metadata)
        self._remotes[remote] = reg.agent_metadata
        return remote

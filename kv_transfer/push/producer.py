"""The push producer's registry and engine-facing API (connector mode): which requests are expected,
registered, streaming or going away, and the service thread that answers decodes. The WRITEs are
``writer.LayerWriter``'s; the socket and its hygiene ``side_channel.SignedSideChannel``'s; the pull
fallback's leases ``kv_transfer.pull.PullLeases``'s. All share this producer's one lock. The
lifecycle of a request (EXPECTING -> READY -> SENDING -> RELEASED, or ABORTED / FAILED / EXPIRED)
and who frees what: ``kv_transfer/base.py``.

Guarantees: once ``finish`` returns, once ``abort``'s ``on_idle`` runs and once a Cancel is
acknowledged, none of the request's WRITEs is still in flight (or, past ``transfer_timeout_s``, they
were given up), so neither side's blocks can be overwritten after they are reused. Nothing waits on
a request that is going away: ``abort`` itself waits at most ``abort_wait_s`` (then the service
thread ends the request once its WRITEs are over and calls ``on_idle``); ``wait_layer`` and
``finish`` raise at once on an abort, a Cancel, a failure or the caller's ``stop()``, which means
"call ``abort`` and free the staging pages in its ``on_idle``", never "free them now"; a decode's
Cancel is acknowledged by the service thread once the WRITEs are over, while it goes on serving.

Pull fallback (route STREAM_THEN_PULL): a Register asking pull makes the request an ordinary
prefill whose blocks ``publish`` leases to the decode. Computed first (route LEASE_FOR_LATER,
``hold``): leased before any decode registers; its Register comes later (``PullLeases.attach``).

Why this file is long: the registry, the engine API and the service thread share one lock and its
invariants; what stands apart (WRITEs, socket, pull leases) is already in its own module.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kv_transfer import wire
from kv_transfer.base import KVPages, ProducerStats, Route, StatsCounter, StreamProducer, TransferState, check_request_id
from kv_transfer.nixl import NixlAgent
from kv_transfer.pull import PullLeases
from kv_transfer.push.side_channel import SignedSideChannel, register_refusal
from kv_transfer.push.writer import LayerWriter, PushRequest
from prefill_server.errors import InvalidRequest, RequestCancelled, TransferError

log = logging.getLogger(__name__)


class PushProducer(StreamProducer):
    """Prefill side of connector mode. ``geometry`` is our pool's (``wire.Geometry``), ``secret``
    the shared HMAC key; ``host``/``port`` the side channel advertised to (and bound for)
    decodes. ``transfer_timeout_s`` bounds every wait for a WRITE (the server keeps it within the
    lease time); ``abort_wait_s`` is the most ``abort`` itself waits for one (then: the service
    thread)."""

    routes = frozenset({Route.STREAM, Route.LEASE_FOR_LATER})

    def __init__(self, pool: KVPages, geometry: wire.Geometry, secret: bytes, *,
                 host: str = "127.0.0.1", port: int = 0, bind_host: str | None = None,
                 register_timeout_s: float = 60.0, transfer_timeout_s: float = 60.0,
                 poll_interval_s: float = 0.002, keep_finished: int = 4096,
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
        self.engine_id = f"prefill-push-{uuid.uuid4()}"
        self._lock = threading.RLock()  # guards _reqs, _finished, the writer's jobs and every NIXL agent call
        self._reqs: dict[str, PushRequest] = {}
        self._finished: OrderedDict[str, TransferState] = OrderedDict()
        self._due: list[Callable[[], None]] = []  # ended requests' on_idle callbacks, not run yet
        self._acks_due: list[tuple[bytes, wire.Ack]] = []  # Cancel Acks now due (the service thread sends them)
        self._keep_finished = keep_finished
        self._stats = StatsCounter()
        self.writer = LayerWriter(pool, geometry, self._lock, self._stats, transfer_timeout_s,
                                  lookup=self._reqs.get, fail=lambda p, why: self._fail(p, why, keep=True))
        self.pull = PullLeases(pool, lease_ttl_s, self._stats, self._ended)  # (pull fallback)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._agent: NixlAgent | None = None
        self._channel: SignedSideChannel | None = None
        self._started = False
        # request id -> [(layer, WRITE posted, WRITE seen done)] (monotonic s), last 256 requests
        self.last_layer_times: OrderedDict[str, list[tuple[int, float, float]]] = OrderedDict()

    @property
    def refused_total(self) -> int:  # messages the side channel refused (malformed, unauthenticated, wrong)
        return self._channel.refused_total if self._channel else 0

    # ---- lifecycle ----
    def start(self) -> None:
        if self._started:
            return
        self._agent = NixlAgent(self.engine_id, progress_thread=False)
        try:
            self._agent.register(self.pool.kv)
            self._channel = SignedSideChannel(self.secret, self.bind_host, self.port)
            self.port = self._channel.port
        except Exception:
            self._close()
            raise
        self._stop.clear()
        self._started = True
        self.writer.start(self._agent)
        self._thread = threading.Thread(target=self._serve, name="kv-producer-push", daemon=True)
        self._thread.start()
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
            _run_callbacks(due)
            if not left:
                break
            time.sleep(0.005)
        with self._lock:
            self.pull.stop()  # leases still held end here
            self._stop.set()
        self.writer.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None
        self._close()
        self._started = False

    def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    # ---- engine API ----
    def expect(self, request_id: str, num_tokens: int, bootstrap_room: int | None = None) -> dict[str, Any]:
        """Announce a request whose decode will register; returns the ``kv_transfer_params`` the
        decode request must carry."""
        if bootstrap_room is not None:  # (SGLang's; our connector's decodes have none)
            raise InvalidRequest("bootstrap_room is SGLang's: use --decode-engine sglang", field="bootstrap_room")
        self._check_new("expect", request_id)
        with self._lock:
            self._refuse_taken(request_id)
            self._reqs[request_id] = PushRequest(request_id, num_tokens)
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
        check_request_id(request_id)

    def _refuse_taken(self, request_id: str) -> None:  # lock held
        if request_id in self._reqs or request_id in self.pull:
            raise InvalidRequest(f"request {request_id} is already in use here", field="request_id")

    def _params(self, request_id: str, num_tokens: int, **extra: Any) -> dict[str, Any]:
        """The ``kv_transfer_params`` that send a decode's connector here for ``request_id``."""
        return {wire.PARAMS_KEY: {"version": wire.PROTOCOL_VERSION, "request_id": request_id,
                                  "host": self.host, "port": self.port, "num_tokens": num_tokens, **extra}}

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
        Returns at once: the writer's poster thread waits for the event and posts. Keep
        ``src_pages`` unchanged until ``finish``/``abort``: its descriptors are built once per
        request and list object."""
        with self._lock:
            p = self._reqs.get(request_id)
            if p is None or p.closing or p.state not in (TransferState.READY, TransferState.SENDING):
                return  # aborted or failed meanwhile: the engine finds out in wait_layer/finish
            self.writer.queue(p, layer, src_pages, ready_event)

    def wait_layer(self, request_id: str, layer: int, stop: Callable[[], bool] | None = None) -> None:
        """Block until layer ``layer`` is posted and its WRITE is done (staging slot reuse).
        Raises at once (TransferError / RequestCancelled) if the request fails, is aborted or
        cancelled, or ``stop()`` turns true meanwhile: then ``abort`` it (a WRITE may still be in
        flight; its ``on_idle`` says when the staging pages are free)."""
        self.writer.wait_posted(request_id, lambda p: layer in p.unposted, stop=stop)
        self.writer.wait(request_id, lambda p: [layer] if layer in p.handles else [], stop=stop)

    def finish(self, request_id: str, timeout_s: float | None = None, stop: Callable[[], bool] | None = None, *,
               first_token: int | None = None, logprobs: Any = None, cached_tokens: int = 0) -> dict[str, Any]:
        """Wait for every WRITE of the request; RELEASED (no WRITE in flight; the first token is
        unused: our connector's decode samples its own). Raises
        TransferError / RequestCancelled at once if the transfer failed, was aborted or cancelled,
        or ``stop()`` turns true: then ``abort`` it and free the staging pages in its ``on_idle``."""
        self.writer.wait_posted(request_id, lambda p: bool(p.unposted), timeout_s, stop=stop)
        self.writer.wait(request_id, lambda p: list(p.handles), timeout_s, stop=stop)
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
                self.writer.drop_jobs(p)
                if not p.abort_reason:
                    p.abort_reason, p.aborted_at = reason or "aborted", p.aborted_at or time.monotonic()
                    self._stats.add(aborted_total=1)
                if on_idle is not None:
                    p.on_idle.append(on_idle)
        if p is None:
            _run_callbacks([on_idle] if on_idle is not None else [])
            return leased
        deadline = time.monotonic() + self.abort_wait_s
        delay = 0.0002
        while True:
            with self._lock:  # (the service thread leaves it alone until abort_wait_s has passed)
                ended = self._reqs.get(request_id) is not p or self._try_end(p)
                due = self._take_due()
            _run_callbacks(due)
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

    # ---- ending requests (lock held) ----
    def _try_end(self, p: PushRequest) -> bool:
        """(lock held) An aborted request: once its WRITEs are over, end it (ABORTED; the decode
        is told; its ``on_idle`` callbacks become due). False while WRITEs are still in flight."""
        if not self.writer.writes_over(p):
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

    def _release_acks(self, p: PushRequest) -> None:
        """(lock held) A cancelled request: once its WRITEs are over, its Acks are due (the service
        thread sends them). The entry stays, ABORTED, for the engine to see (its finish/abort ends it)."""
        if self.writer.writes_over(p):
            self._owe_acks(p)

    def _owe_acks(self, p: PushRequest) -> None:  # (lock held) p's Cancel Acks are due now
        self._acks_due += [(identity, wire.Ack(version=wire.PROTOCOL_VERSION, request_id=p.request_id,
                                               accepted=True, nonce=nonce)) for identity, nonce in p.cancel_acks]
        p.cancel_acks = []

    def _take_due(self) -> list[Callable[[], None]]:  # (lock held) run them once the lock is let go
        due, self._due = self._due, []
        return due

    def _fail(self, p: PushRequest, reason: str, state: TransferState = TransferState.FAILED,
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

    def _end(self, p: PushRequest, state: TransferState) -> None:
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
        self._agent.send_notif(remote, msg)

    # ---- the service thread: the side channel, notifications, WRITE progress, reaping ----
    def _serve(self) -> None:
        channel = self._channel
        assert channel is not None
        poller = channel.poller()
        while not self._stop.is_set():
            due: list[Callable[[], None]] = []
            try:
                for _ in poller.poll(int(self.poll_interval_s * 1000) or 1):
                    if (got := channel.receive()) is not None:
                        self._dispatch(*got)
                with self._lock:
                    if self._agent is not None:
                        for agent, msg in self._agent.get_notifs():  # (also drives UCX progress)
                            self.pull.on_notif(agent, msg)  # a pull READ is over
                        self.pull.expire(self._send_notif)
                        self.writer.progress(self._reqs.values())
                        self._reap()  # aborted requests whose WRITEs are over (or given up)
                        due = self._take_due()
                    acks, self._acks_due = self._acks_due, []
                for identity, ack in acks:  # Cancels whose WRITEs are over
                    channel.reply(identity, ack)
            except Exception:  # noqa: BLE001 - one bad message never stops the service
                log.exception("push side channel error")
                self._stop.wait(0.05)
            _run_callbacks(due)

    def _dispatch(self, identity: bytes, msg: wire.Message) -> None:
        handler = {wire.Cancel: self._cancel, wire.Fetch: self._fetch}.get(type(msg), self._register)
        handler(identity, msg)

    def _fetch(self, identity: bytes, msg: wire.Fetch) -> None:
        with self._lock:
            offer = self.pull.offer(msg, self.engine_id, self._agent.metadata())
        if isinstance(offer, str):
            return self._channel.refuse(identity, msg.request_id, msg.nonce, offer, signed=True)
        self._channel.reply(identity, offer)

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
                self.writer.drop_jobs(p)
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
            return self._channel.accept(identity, msg.request_id, msg.nonce)
        for ident, ack in acks:
            self._channel.reply(ident, ack)
        _run_callbacks(due)

    def _register(self, identity: bytes, reg: wire.Register) -> None:
        def refuse(error: str) -> None:
            self._channel.refuse(identity, reg.request_id, reg.nonce, error, signed=True)

        if why := register_refusal(reg, self.geometry, self.pool):
            return refuse(why)
        needed = self.pool.blocks_needed(reg.num_tokens)
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
                    p.remote = self.writer.load_remote(reg)
                except Exception as e:  # noqa: BLE001
                    return refuse(f"could not load the decode's NIXL metadata: {e}")
                p.reg, p.state = reg, TransferState.READY
                p.ready.set()
        self._stats.add(handshakes_total=1)
        self._channel.accept(identity, reg.request_id, reg.nonce, write_timeout_s=self.transfer_timeout_s)

    def _register_held(self, reg: wire.Register) -> str | None:
        """(lock held) A Register for a request computed first (``hold``): attach the decode to its
        lease, which sends it the "ready" notification. Why not, or None. A refused decode leaves
        the lease as it was: its deadline (or an abort) frees it."""
        if why := self.pull.attach_refusal(reg.request_id, reg.transfer_mode, reg.num_tokens):
            return why
        try:
            remote = self.writer.load_remote(reg)
        except Exception as e:  # noqa: BLE001
            return f"could not load the decode's NIXL metadata: {e}"
        return self.pull.attach(reg.request_id, remote, self._send_notif)


def _run_callbacks(callbacks: list[Callable[[], None]]) -> None:
    for cb in callbacks:
        try:
            cb()
        except Exception:  # noqa: BLE001 - one failing callback never stops the service thread
            log.exception("an abort's on_idle callback failed")

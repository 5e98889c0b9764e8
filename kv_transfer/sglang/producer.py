"""The SGLang producer: streams each layer of a request's KV into an unmodified SGLang 0.5.23 decode
(NIXL backend), keyed by the request's ``bootstrap_room``. The engine drives it as it drives any
``StreamProducer`` (``kv_transfer.base``); the decode drives it through our bootstrap server and
ZMQ socket (``v0_5_23``'s wire). The WRITEs are ``LayerWriter``'s (its poster, waits, give-up),
aimed by ``SGLangTarget``; the messages' hygiene is ``v0_5_23.parse``'s; the decode table
``peers.PeerTable``'s.

A room's life::

    expect(rid, n, room) --EXPECTING--(the decode's transfer info, checked)--> READY
        --(layer_done per layer: converted, WRITTEN)--> SENDING
        --finish(rid, first_token=...): every layer DONE, aux rows WRITTEN--> KV_STATUS success, RELEASED
    EXPECTING past 300 s (SGLang's bootstrap timeout): ``overdue`` says so; the engine fails it
    decode's ABORT: nothing more is posted, ABORT_ACK once no WRITE of the room is in flight
    failure or engine abort: once no WRITE is in flight, KV_STATUS failed (with the reason) and
        ``on_idle`` (the engine frees its staging pages); WRITEs given up after
        ``transfer_timeout_s`` (a decode gone) end it without a status, as SGLang's prefill does:
        the decode's own 300 s waiting timeout (or our dead heartbeat) fails the room there.

A transfer info for a room no request expects yet waits (bounded, 300 s), then gets a failed status.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kv_transfer.base import KVPages, ProducerStats, Route, StatsCounter, StreamProducer, TransferState, check_request_id
from kv_transfer.nixl import NixlAgent, mem_type_of
from kv_transfer.push.writer import LayerWriter
from kv_transfer.sglang import v0_5_23 as wire
from kv_transfer.sglang.bootstrap import BootstrapServer, RankTable
from kv_transfer.sglang.control import ControlSockets
from kv_transfer.sglang.peers import Geometry, PeerTable, destination
from kv_transfer.sglang.rooms import Rooms
from kv_transfer.sglang.target import AUX, AuxRows, ConvertArea, SGLangRequest, SGLangTarget
from prefill_server.errors import InvalidRequest, RequestCancelled, TransferError

log = logging.getLogger(__name__)


class SGLangProducer(StreamProducer):
    """``page_size``/``kv_cache_dtype``: what the decodes run with (``--page-size``,
    ``--kv-cache-dtype``; SGLang refuses a prefill that advertises others). ``host``: the address
    decodes reach us at; ``bootstrap_port``: the bootstrap server's (the router's ``--prefill URL
    PORT``). ``max_tokens``: the longest prompt it converts (default: what two staging slots of
    the pool hold)."""

    routes = frozenset({Route.STREAM})

    def __init__(self, pool: KVPages, page_size: int, *, host: str = "127.0.0.1", bootstrap_port: int = 8998,
                 bind_host: str | None = None, rank_port: int = 0, kv_cache_dtype: str | None = "auto",
                 prefill_http_port: int | None = None, bootstrap_timeout_s: float = wire.BOOTSTRAP_TIMEOUT_S,
                 transfer_timeout_s: float = 60.0, abort_wait_s: float = 0.25, poll_interval_s: float = 0.002,
                 max_tokens: int | None = None, keep_finished: int = 4096, max_pending: int = 4096):
        if not page_size >= 1 or not transfer_timeout_s > 0 or not abort_wait_s >= 0:
            raise ValueError("page_size must be >= 1, transfer_timeout_s > 0 and abort_wait_s >= 0")
        self.pool, self.host, self.bind_host = pool, host, bind_host or host
        self.bootstrap_port, self.rank_port = bootstrap_port, rank_port
        self.kv_cache_dtype, self.prefill_http_port = kv_cache_dtype, prefill_http_port
        self.bootstrap_timeout_s, self.transfer_timeout_s = bootstrap_timeout_s, transfer_timeout_s
        self.abort_wait_s, self.poll_interval_s = min(abort_wait_s, transfer_timeout_s), poll_interval_s
        self.geometry = Geometry(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.kv.element_size(), page_size)
        self.max_tokens = max_tokens or -(-pool.num_blocks // 2) * pool.block_size
        self.engine_id = f"prefill-sglang-{uuid.uuid4()}"
        self._lock = threading.RLock()  # guards the tables below, the writer's jobs and every NIXL agent call
        self._rooms = Rooms(keep_finished, max_pending)
        self._reqs = self._rooms.reqs  # request id -> live request
        self._due: list[Callable[[], None]] = []  # ended requests' on_idle callbacks, run without the lock
        self._stats = StatsCounter()
        self.area = ConvertArea(pool, self.max_tokens)
        self.aux = AuxRows(pool.kv.device)
        self.writer = LayerWriter(pool, None, self._lock, self._stats, transfer_timeout_s, lookup=self._reqs.get,
                                  fail=lambda p, why: self._fail(p, why, keep=True),
                                  target=SGLangTarget(pool, self.geometry, self.area, self._in_flight,
                                                      transfer_timeout_s))
        self._peers = PeerTable(forget=lambda name: self.writer.forget_agent(name))
        self.table = RankTable()
        self._agent: NixlAgent | None = None
        self._control: ControlSockets | None = None
        self._bootstrap: BootstrapServer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self.malformed_total = 0  # decode messages refused as malformed

    # ---- lifecycle ----
    def start(self) -> None:
        if self._started:
            return
        try:
            self._agent = NixlAgent(self.engine_id, progress_thread=False)
            self._agent.register([self.pool.kv, self.area.tensor, self.aux.tensor])
            self._control = ControlSockets(self.bind_host, self.rank_port)
            self._bootstrap = BootstrapServer(self.table, self.bind_host, self.bootstrap_port)
        except Exception:
            self._close()
            raise
        self.rank_port, self.bootstrap_port = self._control.port, self._bootstrap.port
        why = self.table.register(wire.our_rank(self.host, self.rank_port, self.geometry.page_size,
                                                self.kv_cache_dtype, self.prefill_http_port))
        assert why is None, why
        self._stop.clear()
        self._started = True
        self.writer.start(self._agent)
        self._thread = threading.Thread(target=self._serve, name="kv-producer-sglang", daemon=True)
        self._thread.start()
        log.info("sglang producer %s: bootstrap %s:%d, rank socket %d", self.engine_id, self.host,
                 self.bootstrap_port, self.rank_port)

    def stop(self) -> None:
        if not self._started:
            return
        for rid in list(self._reqs):
            self.abort(rid, "the prefill server is stopping")
        while True:  # aborts with WRITEs in flight end here (done, or given up)
            with self._lock:
                self._reap()
                left = any(p.abort_reason for p in self._reqs.values())
                due = self._take_due()
            _run(due)
            if not left:
                break
            time.sleep(0.005)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None
        self.writer.stop()
        with self._lock:
            self._peers.clear()
            self._rooms.clear_parked()
        self._close()
        self._started = False

    def _close(self) -> None:
        for part in (self._bootstrap, self._control, self._agent):
            if part is not None:
                part.close()
        self._bootstrap = self._control = self._agent = None

    # ---- engine API ----
    def expect(self, request_id: str, num_tokens: int, bootstrap_room: int | None = None) -> dict[str, Any]:
        """Announce a request whose SGLang decode will send its transfer info for
        ``bootstrap_room`` (None: a fresh random room). Returns the fields the decode's request
        must carry (what ``sglang-router`` adds): bootstrap_host, bootstrap_port, bootstrap_room."""
        if not self._started:
            raise RuntimeError("SGLangProducer.expect before start()")
        check_request_id(request_id)
        if not 1 <= num_tokens <= self.max_tokens:
            raise InvalidRequest(f"the prompt has {num_tokens} tokens; this server streams 1..{self.max_tokens} "
                                 "to SGLang decodes", field="prompt")
        room = secrets.randbelow(wire.MAX_ROOM) + 1 if bootstrap_room is None else bootstrap_room
        if not isinstance(room, int) or not 1 <= room <= wire.MAX_ROOM:
            raise InvalidRequest(f"bootstrap_room must be an integer in 1..2^63-1, not {room!r}",
                                 field="bootstrap_room")
        with self._lock:
            p = SGLangRequest(request_id, num_tokens, room=room)
            if (parked := self._rooms.add(p)) is not None:
                self._accept(p, parked)
        self._stats.add(published_total=1)
        return {"bootstrap_host": self.host, "bootstrap_port": self.bootstrap_port, "bootstrap_room": room}

    def is_ready(self, request_id: str) -> bool:
        with self._lock:
            p = self._reqs.get(request_id)
            return p is not None and p.state is TransferState.READY

    def wants_pull(self, request_id: str) -> bool:
        return False  # SGLang decodes only take pushed KV

    def overdue(self, request_id: str, now: float | None = None) -> str | None:
        """Why a request still waiting for its decode must fail now, else None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            p = self._reqs.get(request_id)
            if p is None:
                return f"request {request_id} is not expected (aborted?)"
            if p.state.is_terminal:
                return p.error or f"transfer {p.state.value}"
            if p.state is TransferState.EXPECTING and now - p.created > self.bootstrap_timeout_s:
                return (f"no SGLang decode sent its transfer info for bootstrap_room {p.room} within "
                        f"{self.bootstrap_timeout_s:.0f} s (was the decode sent the request, with our bootstrap "
                        f"address {self.host}:{self.bootstrap_port}?)")
        return None

    def layer_done(self, request_id: str, layer: int, src_pages: Sequence[int], ready_event: Any = None) -> None:
        """Layer ``layer`` of the whole prompt sits in flat pool pages ``src_pages`` (page i holds
        tokens [i*N, (i+1)*N)); once ``ready_event`` completed it is converted and WRITTEN. Returns
        at once. Keep ``src_pages`` unchanged until ``wait_layer`` for this layer returned."""
        with self._lock:
            p = self._reqs.get(request_id)
            if p is None or p.closing or p.state not in (TransferState.READY, TransferState.SENDING):
                return  # aborted or failed meanwhile: the engine finds out in wait_layer/finish
            if p.dest is not None and p.dest.num_rows == 0:  # the decode's cache holds the whole prompt:
                p.layers_written.add(layer)  # nothing to write but the aux rows (as SGLang's prefill)
                return
            self.writer.queue(p, layer, src_pages, ready_event)

    def wait_layer(self, request_id: str, layer: int, stop: Callable[[], bool] | None = None) -> None:
        """Block until layer ``layer`` is converted and its WRITE is done. Raises at once
        (TransferError / RequestCancelled) on a failure, abort or ``stop()``: then ``abort`` it."""
        self.writer.wait_posted(request_id, lambda p: layer in p.unposted, stop=stop)
        self.writer.wait(request_id, lambda p: [layer] if layer in p.handles else [], stop=stop)

    def finish(self, request_id: str, timeout_s: float | None = None, stop: Callable[[], bool] | None = None, *,
               first_token: int | None = None, logprobs: Sequence[tuple[int, float]] | None = None,
               cached_tokens: int = 0) -> dict[str, Any]:
        """Wait for every layer's WRITE, WRITE the aux rows (``first_token``, the room, ``logprobs``
        as the engine's ``first_token_logprobs`` gives them, ``cached_tokens``), then tell the decode
        (KV_STATUS success): RELEASED. Raises as ``wait_layer`` does; then ``abort`` it."""
        self.writer.wait_posted(request_id, lambda p: bool(p.unposted), timeout_s, stop=stop)
        self.writer.wait(request_id, lambda p: list(p.handles), timeout_s, stop=stop)
        with self._lock:
            p = self._live(request_id)
            missing = [x for x in range(self.geometry.num_layers) if x not in p.layers_written]
            why = ("the decode never sent its transfer info" if p.dest is None
                   else f"{len(missing)} layer(s) were never written" if missing
                   else "finish() needs the first token: SGLang's decode reads it from the aux row"
                   if first_token is None else "")
            if not why and (slot := self.aux.alloc()) < 0:
                why = "no free aux row: too many SGLang transfers finishing at once"
            if why:
                self._fail(p, why, keep=True)
                raise TransferError(why)
            p.aux_slot = slot
            fields = self.aux.fill(slot, p.room, first_token, logprobs, cached_tokens)
            src, dst = self.aux.descs(slot, fields, p.dest)
            try:
                p.handles[AUX] = self._agent.post("WRITE", src, dst, p.remote, mem_type_of(self.aux.tensor), "DRAM")
            except Exception as e:  # noqa: BLE001
                self._fail(p, f"the aux WRITE could not start: {e}", keep=True)
                raise TransferError(p.error) from e
        self.writer.wait(request_id, lambda p: [AUX] if AUX in p.handles else [], timeout_s, stop=stop)
        with self._lock:
            p = self._live(request_id)
            if AUX not in p.layers_written:
                self._fail(p, "the aux WRITE did not complete", keep=True)
                raise TransferError(p.error)
            self._status(p, ok=True)
            self._end(p, TransferState.RELEASED)
            times = list(p.layer_times)
        self._stats.add(released_total=1)
        return {"layer_times": times, "bootstrap_room": p.room}

    def refuse_room(self, room: int, reason: str) -> None:
        """The request for ``room`` was refused before it reached the engine (a bad field, a prompt
        too long): its decode, sent the same request by the router, gets a failed status with
        ``reason`` at once (now, or when its transfer info comes), not after its 300 s timeout."""
        with self._lock:
            if self._rooms.by_room(room) is not None:
                return  # (a request of this room runs: it tells its decode how it ends)
            if (info := self._rooms.unpark(room)) is not None:
                self._refuse(info, reason)
            else:
                self._rooms.refuse(room, reason, time.monotonic())

    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> None:
        raise TransferError("SGLang decodes take pushed KV only (route stream), not leased blocks")

    def hold(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> dict[str, Any]:
        raise TransferError("SGLang decodes take pushed KV only (route stream), not leased blocks")

    def abort(self, request_id: str, reason: str = "aborted by the prefill server",
              on_idle: Callable[[], None] | None = None) -> bool:
        """Stop the request: nothing more is posted; once none of its WRITEs is in flight its decode
        gets a failed KV_STATUS with ``reason``, it ends (ABORTED) and ``on_idle`` runs (exactly
        once, never under the lock). Waits at most ``abort_wait_s``; after that the service thread
        ends it (WRITEs done, or given up ``transfer_timeout_s`` after the abort). False (and
        ``on_idle`` at once) if the request is unknown."""
        with self._lock:
            p = self._reqs.get(request_id)
            if p is not None:
                p.closing = True
                self.writer.drop_jobs(p)
                if not p.abort_reason:
                    p.abort_reason, p.aborted_at = reason or "aborted", p.aborted_at or time.monotonic()
                    self._stats.add(aborted_total=1)
                if on_idle is not None:
                    p.on_idle.append(on_idle)
        if p is None:
            _run([on_idle] if on_idle is not None else [])
            return False
        deadline, delay = time.monotonic() + self.abort_wait_s, 0.0002
        while True:
            with self._lock:
                ended = self._reqs.get(request_id) is not p or self._try_end(p)
                due = self._take_due()
            _run(due)
            if ended or time.monotonic() >= deadline:
                return True
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def state(self, request_id: str) -> TransferState | None:
        with self._lock:
            p = self._reqs.get(request_id)
            return p.state if p is not None else self._rooms.finished(request_id)

    def stats(self) -> ProducerStats:
        s = self._stats.snapshot()
        with self._lock:
            s.active_leases = len(self._reqs)
        return s

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._reqs)

    # ---- ending requests (lock held) ----
    def _live(self, request_id: str) -> SGLangRequest:
        p = self._reqs.get(request_id)
        if p is None:
            raise RequestCancelled(f"request {request_id} was aborted")
        if p.state.is_terminal:
            raise TransferError(p.error or f"transfer {p.state.value}")
        return p

    def _in_flight(self, p: SGLangRequest, layer: int) -> bool:
        """(the poster thread) A WRITE of (p, layer) is still in flight (polled now)."""
        with self._lock:
            if layer in p.handles and self._agent is not None:
                self.writer.poll_handles(p, [layer])
            return layer in p.handles

    def _try_end(self, p: SGLangRequest) -> bool:
        """An aborted request: once its WRITEs are over, end it (ABORTED). False while in flight."""
        if not self.writer.writes_over(p):
            return False
        self._fail(p, p.abort_reason or p.error or "aborted", TransferState.ABORTED)
        return True

    def _fail(self, p: SGLangRequest, reason: str, state: TransferState = TransferState.FAILED,
              keep: bool = False) -> None:
        """Terminal failure. ``keep``: leave the entry for the engine's finish/abort to see (it ends
        it); otherwise it ends now if no WRITE is in flight (the decode is told then)."""
        if not p.state.is_terminal:
            p.error = p.error or reason
            p.state = state
            p.ready.set()
            log.warning("sglang push of %s (room %d) failed: %s", p.request_id, p.room, reason)
        if not keep and not p.handles:
            self._end(p, p.state)

    def _end(self, p: SGLangRequest, state: TransferState) -> None:
        p.state = state
        self._rooms.remove(p, state)
        if state is not TransferState.RELEASED:
            self._status(p, ok=False)
        self._send_acks(p)
        if not p.gave_up:  # (a given-up WRITE may still read it)
            self.aux.free(p.aux_slot)
        self._due += p.on_idle
        p.on_idle = []

    def _status(self, p: SGLangRequest, ok: bool) -> None:
        """Tell the room's decode how it ended: once, never after the decode aborted it, and never
        after a given-up WRITE (it may still land: the decode's waiting timeout frees the pages)."""
        if p.dest is None or p.status_sent or p.gave_up or (not ok and p.decode_aborted):
            return
        p.status_sent = True
        self._send(*p.dest.endpoint, wire.kv_status(p.room, ok, p.error))

    def _send(self, host: str, port: int, frames: list[bytes]) -> None:
        if self._control is not None:
            self._control.send(host, port, frames)

    def _send_acks(self, p: SGLangRequest) -> None:
        """ABORT_ACKs owed for p: its WRITEs are over (a given-up one poisons the room: the decode
        waits its own release timeout instead, as with SGLang's prefill)."""
        targets, p.ack_targets = p.ack_targets, []
        for host, port, gen in targets if not p.gave_up else ():
            self._send(host, port, wire.abort_ack(p.room, gen))

    def _take_due(self) -> list[Callable[[], None]]:
        due, self._due = self._due, []
        return due

    def _reap(self) -> None:
        """(lock held) Decode-aborted rooms whose WRITEs are over get their ABORT_ACK; aborted
        requests past ``abort_wait_s`` end once their WRITEs are over (or given up)."""
        now = time.monotonic()
        for p in list(self._reqs.values()):
            if p.ack_targets and self.writer.writes_over(p):
                self._send_acks(p)
            if p.abort_reason and now >= p.aborted_at + self.abort_wait_s:
                self._try_end(p)

    # ---- the service thread: the decode's messages, WRITE progress, reaping, expiry ----
    def _serve(self) -> None:
        control = self._control
        poller = control.poller()
        while not self._stop.is_set():
            due: list[Callable[[], None]] = []
            try:
                for _ in range(64 if poller.poll(int(self.poll_interval_s * 1000) or 1) else 0):
                    if (frames := control.receive()) is None:
                        break
                    self._on_message(frames)
                with self._lock:
                    self.writer.progress(self._reqs.values())
                    self._reap()
                    self._rooms.forget_refusals(time.monotonic() - self.bootstrap_timeout_s)
                    for info in self._rooms.expired(time.monotonic() - self.bootstrap_timeout_s):
                        self._refuse(info, f"no request with bootstrap_room {info.room} reached this prefill "
                                           f"within {self.bootstrap_timeout_s:.0f} s")
                    due = self._take_due()
            except Exception:  # noqa: BLE001 - one bad message never stops the service
                log.exception("sglang producer: service error")
                self._stop.wait(0.05)
            _run(due)

    def _on_message(self, frames: list[bytes]) -> None:
        if frames and frames[0] in wire.IGNORED_TAGS:
            return
        try:
            msg = wire.parse(frames)
        except wire.MalformedMessage as e:
            self.malformed_total += 1
            log.warning("sglang producer: ignored a malformed decode message: %s", e)
            return
        with self._lock:
            if isinstance(msg, wire.Registration):
                peer = self._peers.add(msg, self.geometry, self.writer.load_agent)
                if peer.refusal:
                    log.warning("sglang decode %s refused: %s", msg.agent_name, peer.refusal)
            elif isinstance(msg, wire.TransferInfo):
                self._on_transfer_info(msg)
            else:
                self._on_abort(msg)

    def _on_transfer_info(self, info: wire.TransferInfo) -> None:  # (lock held)
        p = self._rooms.by_room(info.room)
        if p is None and (why := self._rooms.refusal(info.room)) is not None:
            self._refuse(info, why)  # its request was refused here
        elif p is None:  # the decode was first: keep it for expect() (bounded, and for 300 s)
            for old in self._rooms.park(info, time.monotonic()):
                self._refuse(old, "too many rooms waiting for their prefill request here")
        elif p.dest is not None or p.state is not TransferState.EXPECTING:
            self._refuse(info, f"bootstrap_room {info.room} already has a decode here, or has ended")
        else:
            self._accept(p, info)

    def _accept(self, p: SGLangRequest, info: wire.TransferInfo) -> None:  # (lock held)
        dest = destination(self._peers.get(info.agent_name), info, p.num_tokens, self.geometry)
        if isinstance(dest, str):
            self._refuse(info, dest)
            p.status_sent = True
            return self._fail(p, dest, keep=True)  # (the engine sees it in overdue())
        p.dest, p.remote, p.state = dest, dest.peer.remote, TransferState.READY
        p.ready.set()
        self._stats.add(handshakes_total=1)

    def _refuse(self, info: wire.TransferInfo, why: str) -> None:  # (lock held)
        log.warning("sglang room %d from %s refused: %s", info.room, info.agent_name, why)
        self._send(info.endpoint, info.port, wire.kv_status(info.room, False, why))

    def _on_abort(self, msg: wire.Abort) -> None:  # (lock held)
        """Nothing more is posted for the room; its ABORT_ACK goes once no WRITE of it is in flight
        (at once here in the usual case, else from ``_reap``). The engine finds out at its next
        ``wait_layer``/``finish``/``overdue`` and aborts, which ends the entry."""
        self._rooms.unpark(msg.room)
        p = self._rooms.by_room(msg.room)
        ack = (msg.endpoint, msg.port, msg.generation) if msg.generation is not None else None
        if p is None:
            if ack:
                self._send(ack[0], ack[1], wire.abort_ack(msg.room, ack[2]))
            return
        p.closing, p.decode_aborted = True, True
        self.writer.drop_jobs(p)
        if not p.state.is_terminal:
            p.error, p.state = "aborted by the decode", TransferState.ABORTED
            p.ready.set()
        p.aborted_at = p.aborted_at or time.monotonic()  # (the give-up deadline counts from here)
        if ack:
            p.ack_targets.append(ack)
        if self.writer.writes_over(p):
            self._send_acks(p)


def _run(callbacks: list[Callable[[], None]]) -> None:
    for cb in callbacks:
        try:
            cb()
        except Exception:  # noqa: BLE001 - one failing callback never stops the service
            log.exception("an abort's on_idle callback failed")

"""The layer writer of a push: queues each computed layer, posts its NIXL WRITE from a poster thread
(never on the forward's thread), tracks the WRITE handles, and waits for them with a bound, giving
up those still in flight after ``transfer_timeout_s``.

``PushRequest`` is one request's transfer state, shared with the producer (``producer.py``),
which owns the registry; both work under the producer's one lock. Methods named ``*_locked`` and
those documented "(lock held)" expect the caller to hold it.

Posting: ``queue`` records (request, layer, pages, event) and returns; the poster thread waits on the
event (the layer's K/V are in the pages), builds the layer's descriptors (once per request and
staging slot, then only the decode's layer base moves) and posts the WRITE with the notification
"psv1 done rid l". So the GPU's queue never drains at a layer boundary: the poster waits while the
next layers compute.

Where the bytes go is the writer's ``target`` (``LayerTarget``): by default ``RegisterTarget``, the
decode that sent our Register (``kv_transfer.wire``); SGLang decodes have their own
(``kv_transfer.sglang.target``). The queue, the poster, the waits and the give-up are the same.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kv_transfer import layout, wire
from kv_transfer.base import KVPages, StatsCounter, TransferState
from kv_transfer.nixl import NixlAgent, device_id_of, mem_type_of
from prefill_server.errors import RequestCancelled, TransferError

log = logging.getLogger(__name__)


@dataclass
class PushRequest:
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
    gave_up: bool = False  # WRITEs were given up while in flight: they may still land in the decode's blocks


class LayerTarget(Protocol):
    """Where a request's layers go: the poster thread asks it for each layer's descriptors (after
    the layer's K/V are ready; it may convert them first) and what to post them with."""

    def layer_descs(self, p: PushRequest, layer: int, src_pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Coalesced Nx3 (addr, len, dev) (local, remote) descriptors of layer ``layer``."""

    def remote_mem_type(self, p: PushRequest) -> str: ...

    def notif(self, p: PushRequest, layer: int) -> bytes:
        """The NIXL notification the WRITE carries (b"": none)."""


class RegisterTarget:
    """The decode that registered with our side channel (``p.reg``, a ``wire.Register``): our pool's
    pages as they are, into its blocks in its page layout, notification "psv1 done rid l"."""

    def __init__(self, pool: KVPages, geometry: wire.Geometry):
        self.pool, self.geometry = pool, geometry

    def remote_mem_type(self, p: PushRequest) -> str:
        assert p.reg is not None
        return p.reg.mem_type

    def notif(self, p: PushRequest, layer: int) -> bytes:
        return wire.done_notif(p.request_id, layer)

    def layer_descs(self, p: PushRequest, layer: int, src_pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Coalesced (src, dst) descriptors of one layer, per the decode's page layout
        (``kv_transfer.layout``). The runs depend only on the pages and the decode's block ids and
        strides, not on the layer: built once per request and staging slot (the page
        list object), then each layer only adds its base address on the decode."""
        reg = p.reg
        assert reg is not None
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


class LayerWriter:
    """``lock``: the producer's (it guards the requests and every NIXL agent call); ``lookup(rid)``:
    the producer's live request of that id, or None; ``fail(p, reason)``: fail a request and tell
    its decode, keeping the entry for the engine to see; ``target``: where the layers go (default:
    ``RegisterTarget``)."""

    def __init__(self, pool: KVPages, geometry: wire.Geometry | None, lock: threading.RLock, stats: StatsCounter,
                 transfer_timeout_s: float, lookup: Callable[[str], PushRequest | None],
                 fail: Callable[[PushRequest, str], None], target: LayerTarget | None = None):
        self.pool, self.geometry, self.stats = pool, geometry, stats
        if target is None:
            assert geometry is not None, "the default target (RegisterTarget) needs our pool's geometry"
            target = RegisterTarget(pool, geometry)
        self.target = target
        self.transfer_timeout_s = transfer_timeout_s
        self._lock, self._lookup, self._fail = lock, lookup, fail
        self._posted_cv = threading.Condition(lock)  # notified: a job queued, handled or dropped
        self._jobs: deque[tuple[PushRequest, int, Sequence[int], Any]] = deque()
        self._poster: threading.Thread | None = None
        self._stopping = False
        self.agent: NixlAgent | None = None  # set while started
        self._remotes: dict[str, bytes] = {}  # decodes' agent name -> the metadata loaded

    # ---- lifecycle ----
    def start(self, agent: NixlAgent) -> None:
        self.agent, self._stopping = agent, False
        self._poster = threading.Thread(target=self._post_loop, name="kv-producer-post", daemon=True)
        self._poster.start()

    def load_remote(self, reg: wire.Register) -> str:
        """(lock held) The decode's NIXL agent name, its metadata loaded (reloaded if it changed)."""
        return self.load_agent(reg.agent_name, reg.agent_metadata)

    def load_agent(self, agent_name: str, metadata: bytes) -> str:
        """(lock held) A peer's NIXL agent name, its metadata loaded (reloaded if it changed)."""
        if self._remotes.get(agent_name) == metadata:
            return agent_name
        if agent_name in self._remotes:
            self.forget_agent(agent_name)
        remote = self.agent.add_remote(metadata)
        self._remotes[remote] = metadata
        return remote

    def forget_agent(self, agent_name: str) -> None:
        """(lock held) Unload a peer's metadata (a peer table that evicts it)."""
        if self._remotes.pop(agent_name, None) is not None:
            self.agent.remove_remote(agent_name)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._posted_cv.notify_all()
        if self._poster is not None:
            self._poster.join(timeout=10)
            self._poster = None
        self.agent, self._remotes = None, {}

    # ---- posting ----
    def queue(self, p: PushRequest, layer: int, src_pages: Sequence[int], ready_event: Any) -> None:
        """(lock held) Queue layer ``layer`` of ``p`` for the poster thread."""
        if not self._poster or not self._poster.is_alive():
            raise RuntimeError("PushProducer.layer_done: the poster thread is not running (stopped?)")
        p.unposted.add(layer)
        self._jobs.append((p, layer, src_pages, ready_event))
        self._posted_cv.notify_all()

    def _post_loop(self) -> None:
        """The poster thread: for each queued layer, wait for its event, build and post its WRITE."""
        while True:
            with self._lock:
                while not self._jobs and not self._stopping:
                    self._posted_cv.wait()
                if not self._jobs:
                    return
                p, layer, src_pages, event = self._jobs.popleft()
            try:
                self._post_layer(p, layer, src_pages, event)
            except Exception as e:  # noqa: BLE001 - the request fails; the engine sees it in wait_layer/finish
                log.exception("posting layer %d of %s failed", layer, p.request_id)
                with self._lock:
                    self._fail(p, f"WRITE of layer {layer} could not start: {type(e).__name__}: {e}")
            finally:
                with self._lock:
                    p.unposted.discard(layer)
                    self._posted_cv.notify_all()

    def _post_layer(self, p: PushRequest, layer: int, src_pages: Sequence[int], ready_event: Any) -> None:
        with self._lock:
            if p.closing or p.state not in (TransferState.READY, TransferState.SENDING):
                return
        if ready_event is not None:
            ready_event.synchronize()
        src, dst = self.target.layer_descs(p, layer, src_pages)
        t = time.monotonic()
        with self._lock:
            if p.closing or p.state.is_terminal:
                return  # an abort/cancel/failure came meanwhile: it waits for the WRITEs in p.handles only
            try:
                assert self.agent is not None
                h = self.agent.post("WRITE", src, dst, p.remote, mem_type_of(self.pool.kv),
                                    self.target.remote_mem_type(p), notif=self.target.notif(p, layer))
            except Exception as e:  # noqa: BLE001
                self._fail(p, f"WRITE of layer {layer} could not start: {e}")
                return
            p.handles[layer] = h
            p.state = TransferState.SENDING
            p.layer_times.append((layer, t, 0.0))
        self.stats.add(bytes_offered_total=int(src[:, 1].sum()))

    def drop_jobs(self, p: PushRequest) -> None:
        """(lock held) Remove the request's queued layers (the one being posted, if any, stays:
        it checks ``closing`` under the lock before posting)."""
        kept = deque(j for j in self._jobs if j[0] is not p)
        for j in self._jobs:
            if j[0] is p:
                p.unposted.discard(j[1])
        self._jobs = kept
        self._posted_cv.notify_all()

    # ---- waiting ----
    def wait_posted(self, request_id: str, pending, timeout_s: float | None = None,
                    stop: Callable[[], bool] | None = None) -> None:
        """Block until ``pending(p)`` is false: the poster has handled those layers. A request gone
        or going away meanwhile returns at once (``wait`` raises then); past the timeout the
        request fails (nothing more is posted)."""
        limit = timeout_s or self.transfer_timeout_s
        deadline = time.monotonic() + limit
        with self._lock:
            while True:
                p = self._lookup(request_id)
                if p is None or not pending(p) or p.closing or p.state.is_terminal or (stop and stop()):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    p.closing = True
                    self.drop_jobs(p)
                    self._fail(p, f"layers {sorted(p.unposted)} not posted within {limit:.0f} s "
                                  "(their K/V never became ready?)")
                    return
                self._posted_cv.wait(min(left, 0.05) if stop else left)

    def wait(self, request_id: str, which, timeout_s: float | None = None,
             stop: Callable[[], bool] | None = None) -> None:
        """Wait until none of the WRITEs ``which(p)`` names is in flight. Raises at once, without
        waiting for them, when the request failed, is going away or ``stop()`` holds (its abort
        waits for them); past the timeout they are given up and the request fails."""
        limit = timeout_s or self.transfer_timeout_s
        deadline = time.monotonic() + limit
        delay = 0.0002
        while True:
            with self._lock:
                p = self._lookup(request_id)
                if p is None:
                    raise RequestCancelled(f"request {request_id} was aborted")
                self.poll_handles(p, which(p))
                if p.state.is_terminal and p.state is not TransferState.RELEASED:
                    raise TransferError(p.error or f"transfer {p.state.value}")
                if p.closing or (stop is not None and stop()):
                    raise RequestCancelled(f"request {request_id} was aborted")
                if not [layer for layer in which(p) if layer in p.handles]:
                    return
                if time.monotonic() >= deadline:
                    self.give_up(p, limit)
                    raise TransferError(p.error)
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    # ---- handles (lock held) ----
    def poll_handles(self, p: PushRequest, layers) -> None:
        """(lock held) Check the WRITEs of ``layers`` still in flight; release the finished ones
        (DONE: the layer is written; an error state fails the request)."""
        for layer in [x for x in layers if x in p.handles]:
            state = self.agent.poll(p.handles[layer])
            if state == "PROC":
                continue
            self.agent.release(p.handles.pop(layer))
            lt = [x for x in p.layer_times if x[0] == layer]
            if lt:
                p.layer_times[p.layer_times.index(lt[-1])] = (layer, lt[-1][1], time.monotonic())
            if state == "DONE":
                p.layers_written.add(layer)
            else:
                self._fail(p, f"WRITE of layer {layer} failed: {state}")

    def give_up(self, p: PushRequest, limit: float) -> None:
        """(lock held) WRITEs still in flight after ``limit`` seconds: fail the request (the decode
        is told) and release their handles."""
        self._fail(p, f"WRITEs still in flight after {limit:g} s (decode gone?)")
        for h in p.handles.values():
            self.agent.release(h)
        p.gave_up = p.gave_up or bool(p.handles)
        p.handles.clear()

    def writes_over(self, p: PushRequest) -> bool:
        """(lock held) An aborted or cancelled request: True once none of its WRITEs is in flight
        (those still in flight ``transfer_timeout_s`` after the abort/Cancel are given up)."""
        self.poll_handles(p, list(p.handles))
        if p.handles and time.monotonic() < p.aborted_at + self.transfer_timeout_s:
            return False
        if p.handles:
            self.give_up(p, self.transfer_timeout_s)
        return True

    def progress(self, requests) -> None:
        """(lock held) Check the state of every in-flight WRITE (releasing none: ``wait`` and
        ``writes_over`` do). NIXL moves a transfer on, and sends its notification, only when its
        state is checked: checked only by ``wait_layer`` (two layers later) and ``finish``, a 128K
        layer's WRITE reached the decode ~106 ms after it was posted on an H200 (nixl-cu13 1.5.1,
        cuda_ipc; the copy itself takes 0.5 ms), and 2 ms after when checked every millisecond."""
        for p in requests:
            for h in p.handles.values():
                self.agent.poll(h)

"""Receiving end of connector mode, independent of vLLM: owns the destination KV caches' NIXL
registration, sends authenticated ``Register``/``Cancel``/``Fetch`` messages to prefill servers,
counts the per-layer "done" notifications the prefill's WRITEs carry (push), or READs the KV the
prefill leased for it (pull fallback, ``kv_transfer.pull``). Our vLLM connector
(``kv_transfer.vllm.connector``) wraps it; tests and benchmarks use it directly as "a decode".

Page layouts: the caches are vLLM's per-layer views (logical ``[num_blocks, H, N, 2D]`` in any of
``kv_transfer.layout.LAYOUTS``); the Register names the layout and gives its strides, and
``poll()`` converts received pages in place where the layout needs it, before it reports them.

Threads: ``register``/``cancel`` only queue work; a pool of threads does the ZMQ round trips
(so a forward never waits on the network); another drives NIXL progress every ``progress_s``,
counts notifications and polls READs. Over UCX transports that are not true RDMA (TCP, shared
memory) the target must progress for WRITEs to land, and vLLM only calls the connector once per
engine step, which can be seconds apart on a busy CPU: the progress thread makes transfer speed
independent of that. ``poll()`` returns what completed, failed, or finished cancelling since the
last call. A request fails when the prefill refuses it, sends "fail", its READ fails or ends after
the prefill's lease, or nothing happens for ``timeout_s`` (pull: the prefill computes the whole
prompt before the "ready" notification, so this must cover a whole prefill). A failed or cancelled
pull request with a READ in flight is reported only once that READ is over, so the decode never
reuses blocks a READ can still write into.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np  # noqa: F401  (nixl needs it importable)
import torch
import zmq

from kv_transfer import layout, pull, wire
from kv_transfer.nixl import NixlAgent, device_id_of, mem_type_of

log = logging.getLogger(__name__)


@dataclass
class _Recv:
    request_id: str
    num_layers: int
    deadline: float
    block_ids: list[int]
    first_token: int
    num_tokens: int
    host: str
    port: int
    mode: str = "push"
    layers: set[int] = field(default_factory=set)
    first_layer_at: float = 0.0
    # pull
    fetching: bool = False  # the "ready" came: a Fetch is queued or on its way
    reading: bool = False  # a READ is being posted or in flight (cancel/fail wait for it)
    read: Any = None  # the READ's NIXL handle
    lease_end: float = 0.0  # the prefill's lease ends (our clock, conservatively early)
    failed: str = ""  # failed while a READ was in flight: reported once it is over
    cancelled: bool = False  # likewise, cancelled


@dataclass
class PollResult:
    done: set[str] = field(default_factory=set)  # every layer arrived
    failed: dict[str, str] = field(default_factory=dict)  # request id -> reason
    cancelled: set[str] = field(default_factory=set)  # Cancel acknowledged: no WRITE in flight


class PushReceiver:
    """``caches``: one tensor per layer, vLLM's logical ``[num_blocks, H, N, 2D]`` views in one of
    ``kv_transfer.layout.LAYOUTS`` (``layout``: the name vLLM resolved, checked against the
    strides), all on one device. ``geometry`` describes them; its ``page_layout`` is filled in."""

    def __init__(self, caches: list[torch.Tensor], geometry: wire.Geometry, secret: bytes, *,
                 engine_id: str | None = None, timeout_s: float = 120.0, rpc_timeout_s: float = 10.0,
                 progress_s: float = 0.001, layout_name: str | None = None):
        if len(caches) != geometry.num_layers:
            raise ValueError(f"{len(caches)} caches for {geometry.num_layers} layers")
        want = (geometry.num_kv_heads, geometry.block_size, 2 * geometry.head_dim)
        if tuple(caches[0].shape[1:]) != want:
            raise ValueError(f"cache of shape {tuple(caches[0].shape)} is not [num_blocks, {want[0]}, "
                             f"{want[1]}, {want[2]}] (blocks, KV heads, block size, K|V channels)")
        self.addressing = layout.describe(caches, layout_name)  # ValueError: not a known layout
        geometry = msgspec.structs.replace(geometry, page_layout=self.addressing.layout)
        if self.addressing.page_bytes != geometry.page_bytes:
            raise ValueError(f"cache dtype {caches[0].dtype} does not match the geometry's {geometry.dtype}")
        self.caches, self.geometry, self.secret = caches, geometry, secret
        self.engine_id = engine_id or f"decode-{uuid.uuid4()}"
        self.timeout_s, self.rpc_timeout_s = timeout_s, rpc_timeout_s
        self.block_stride = self.addressing.block_stride
        self.agent = NixlAgent(self.engine_id, progress_thread=False)
        self.agent.register(caches)
        self.metadata = self.agent.metadata()
        self._lock = threading.Lock()
        self._recv: dict[str, _Recv] = {}
        self._result = PollResult()
        self._to_convert: dict[str, list[int]] = {}  # done, pages still to convert (poll())
        self._remotes: dict[str, bytes] = {}  # prefill agent name -> metadata loaded
        self._quiet: set[str] = set()  # Cancels we sent for failed pull requests (not reported)
        self._jobs: queue.Queue = queue.Queue()
        self._zmq = zmq.Context()
        self._stop = threading.Event()
        self.progress_s = progress_s
        self._agent_lock = threading.Lock()
        self._thread = threading.Thread(target=self._rpc_loop, name="kv-receiver-rpc", daemon=True)
        self._thread.start()
        self._progress = threading.Thread(target=self._progress_loop, name="kv-receiver-progress", daemon=True)
        self._progress.start()

    # ---- caller API ----
    def register(self, host: str, port: int, request_id: str, block_ids: list[int], first_token: int,
                 num_tokens: int, mode: str = "push") -> None:
        """Ask the prefill at host:port for request_id's KV in ``block_ids``: it WRITEs each layer
        (``mode`` "push") or leases its blocks for us to READ ("pull")."""
        if mode not in wire.TRANSFER_MODES:
            raise ValueError(f"transfer mode must be one of {wire.TRANSFER_MODES}, not {mode!r}")
        block_ids = [int(b) for b in block_ids]
        with self._lock:
            self._recv[request_id] = _Recv(request_id, self.geometry.num_layers, time.monotonic() + self.timeout_s,
                                           block_ids, first_token, num_tokens, host, port, mode)
        c, a = self.caches[0], self.addressing
        reg = wire.Register(
            version=wire.PROTOCOL_VERSION, request_id=request_id, engine_id=self.engine_id,
            agent_name=self.engine_id, agent_metadata=self.metadata, geometry=self.geometry,
            mem_type=mem_type_of(c), device_id=device_id_of(c), layer_addrs=list(a.layer_addrs),
            block_stride=a.block_stride, head_stride=a.head_stride, token_stride=a.token_stride,
            block_ids=block_ids, first_token=first_token, num_tokens=num_tokens, transfer_mode=mode,
            nonce=b"", timestamp=0.0)
        self._jobs.put((host, port, reg))

    def cancel(self, host: str, port: int, request_id: str) -> None:
        """Stop a transfer; ``poll().cancelled`` reports it once nothing can land any more."""
        with self._lock:
            r = self._recv.get(request_id)
            if r is not None and r.reading:  # a READ may be writing our blocks: wait for it; its
                r.cancelled = True           # notification frees the prefill's lease
                return
            self._recv.pop(request_id, None)
        self._jobs.put((host, port, wire.Cancel(version=wire.PROTOCOL_VERSION, request_id=request_id,
                                                nonce=b"", timestamp=0.0)))

    def pending(self) -> int:
        with self._lock:
            return len(self._recv)

    def poll(self) -> PollResult:
        """What ended since the last call. Pages of requests reported done are converted to the
        cache's layout first (on the caller's thread, e.g. vLLM's worker)."""
        self._drain()
        now = time.monotonic()
        with self._lock:
            for rid, r in list(self._recv.items()):
                if now > r.deadline:
                    self._give_up(r, f"no KV from the prefill server for {self.timeout_s:.0f} s "
                                     f"({len(r.layers)} of {r.num_layers} layers arrived)" if r.mode == "push"
                                  else f"the prefill server's KV was not read within {self.timeout_s:.0f} s")
            out, self._result = self._result, PollResult()
            convert = {rid: self._to_convert.pop(rid) for rid in out.done if rid in self._to_convert}
        for blocks in convert.values():
            for cache in self.caches:
                layout.convert_received(cache, blocks)
        return out

    def close(self) -> None:
        self._stop.set()
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self._progress.join(timeout=5)
        self._zmq.term()
        with self._agent_lock:
            self.agent.close()

    # ---- state changes (lock held) ----
    def _finish(self, r: _Recv) -> None:
        self._recv.pop(r.request_id, None)
        if r.cancelled:
            self._result.cancelled.add(r.request_id)
        elif r.failed:
            self._result.failed[r.request_id] = r.failed
        else:
            self._result.done.add(r.request_id)
            if layout.needs_conversion(self.addressing):
                bs = self.geometry.block_size
                self._to_convert[r.request_id] = r.block_ids[r.first_token // bs: -(-r.num_tokens // bs)]

    def _give_up(self, r: _Recv, reason: str) -> None:
        """Fail ``r`` now, or once its READ is over. A pull request not read yet is cancelled on
        the prefill too, so its compute or lease ends now rather than at the lease's deadline."""
        r.failed = r.failed or reason
        if not r.reading:
            self._finish(r)
            if r.mode == "pull":
                self._quiet.add(r.request_id)
                self._jobs.put((r.host, r.port, wire.Cancel(version=wire.PROTOCOL_VERSION, request_id=r.request_id,
                                                            nonce=b"", timestamp=0.0)))

    # ---- progress thread ----
    def _drain(self) -> None:
        with self._agent_lock:
            try:
                notifs = self.agent.get_notifs()
            except Exception:  # noqa: BLE001 - e.g. a peer that died; timeouts catch its requests
                log.warning("NIXL notification poll failed", exc_info=True)
                return
            with self._lock:
                reads = [(r, r.read) for r in self._recv.values() if r.read is not None]
            states = {r.request_id: self.agent.poll(h) for r, h in reads}
            for r, h in reads:
                if states[r.request_id] != "PROC":
                    self.agent.release(h)
        now = time.monotonic()
        with self._lock:
            for r, _ in reads:
                state = states[r.request_id]
                if state == "PROC":
                    continue
                r.read, r.reading = None, False
                if state != "DONE":
                    r.failed = r.failed or f"the READ from the prefill server failed: {state}"
                elif now > r.lease_end:
                    r.failed = r.failed or "the READ ended after the prefill's lease: its blocks may be reused"
                self._finish(r)
            for _agent, msg in notifs:
                self._on_notif(msg, now)

    def _on_notif(self, msg: bytes, now: float) -> None:
        parsed = wire.parse_notif(msg)
        if parsed is None:
            return
        kind, rid, arg = parsed
        r = self._recv.get(rid)
        if r is None:
            return
        if kind == "fail":
            self._give_up(r, f"the prefill server failed: {arg}")
        elif kind == "ready" and r.mode == "pull" and not r.fetching:
            r.fetching = True
            r.deadline = now + self.timeout_s
            self._jobs.put((r.host, r.port, wire.Fetch(version=wire.PROTOCOL_VERSION, request_id=rid,
                                                       nonce=b"", timestamp=0.0)))
        elif kind == "done" and r.mode == "push" and arg.isdigit() and int(arg) < r.num_layers:
            r.layers.add(int(arg))
            r.first_layer_at = r.first_layer_at or now
            r.deadline = now + self.timeout_s  # progress: the clock restarts
            if len(r.layers) == r.num_layers:
                self._finish(r)

    def _progress_loop(self) -> None:
        while not self._stop.wait(self.progress_s):
            try:
                self._drain()
            except Exception:  # noqa: BLE001 - keep progressing
                log.exception("receiver progress loop error")

    # ---- background RPCs ----
    def _rpc_loop(self) -> None:
        # a pool, so that one unreachable prefill (each RPC waits up to rpc_timeout_s) does not hold
        # up registrations with the others
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-receiver-rpc") as pool:
            while not self._stop.is_set():
                job = self._jobs.get()
                if job is None:
                    return
                pool.submit(self._run_job, *job)

    def _run_job(self, host: str, port: int, msg) -> None:
        t_sent = time.monotonic()
        try:
            sent, reply, err = self._rpc(host, port, msg)
        except Exception as e:  # noqa: BLE001
            sent, reply, err = msg, None, f"{type(e).__name__}: {e}"
        if isinstance(msg, wire.Cancel):  # (an unreachable prefill cannot write either)
            with self._lock:
                if msg.request_id in self._quiet:
                    self._quiet.discard(msg.request_id)
                else:
                    self._result.cancelled.add(msg.request_id)
        elif isinstance(msg, wire.Fetch) and not err:
            self._read(reply, sent.nonce, t_sent)
        elif err:
            with self._lock:
                r = self._recv.get(msg.request_id)
                if r is not None:
                    self._give_up(r, err)

    def _read(self, offer: wire.Offer, nonce: bytes, t_sent: float) -> None:
        """Pull: READ what the Offer points at, telling the prefill when done."""
        with self._lock:
            r = self._recv.get(offer.request_id)
            if r is None or r.reading:
                return  # cancelled or failed meanwhile (a Cancel frees the lease)
            if why := pull.check_offer(offer, nonce, self.geometry, r.num_tokens, self.secret):
                return self._give_up(r, why)
            r.reading, r.lease_end = True, t_sent + 0.9 * offer.lease_s
        try:
            local, remote = pull.read_descs(offer, self.geometry, self.addressing, r.block_ids, r.first_token,
                                            r.num_tokens, device_id_of(self.caches[0]))
            with self._agent_lock:
                if self._remotes.get(offer.agent_name) != offer.agent_metadata:
                    if offer.agent_name in self._remotes:
                        self.agent.remove_remote(offer.agent_name)
                    self._remotes[self.agent.add_remote(offer.agent_metadata)] = offer.agent_metadata
                h = self.agent.post("READ", local, remote, offer.agent_name, mem_type_of(self.caches[0]),
                                    offer.mem_type, notif=wire.read_notif(offer.request_id, offer.release_token))
        except Exception as e:  # noqa: BLE001 - nothing in flight: fail now
            with self._lock:
                r.reading = False
                self._give_up(r, f"could not READ from the prefill server: {type(e).__name__}: {e}")
            return
        with self._lock:
            r.read = h

    def _rpc(self, host: str, port: int, msg) -> tuple[Any, Any, str]:
        """Send one signed message; (what was sent, the reply, '' if accepted else why not)."""
        msg = wire.sign(self.secret, msgspec.structs.replace(msg, nonce=wire.new_nonce(), timestamp=time.time()))
        sock = self._zmq.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self.rpc_timeout_s * 1000))
        try:
            h = f"[{host}]" if ":" in host else host
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(f"tcp://{h}:{port}")
            sock.send(wire.encode(msg))
            try:
                reply = wire.decode(sock.recv())
            except zmq.Again:
                return msg, None, (f"the prefill server at {host}:{port} did not answer within "
                                   f"{self.rpc_timeout_s:.0f} s")
        finally:
            sock.close(linger=0)
        if isinstance(reply, wire.Offer) and isinstance(msg, wire.Fetch) and reply.request_id == msg.request_id:
            return msg, reply, ""  # (check_offer authenticates it)
        if not isinstance(reply, wire.Ack) or reply.request_id not in (msg.request_id, ""):
            return msg, reply, "the prefill server sent an unexpected reply"
        if not reply.accepted:
            return msg, reply, f"the prefill server refused: {reply.error}"
        if reply.nonce != msg.nonce or not wire.verify(self.secret, reply):
            return msg, reply, "the prefill server's reply failed authentication (wrong secret?)"
        return msg, reply, ""

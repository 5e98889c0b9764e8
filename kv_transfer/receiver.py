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

The same rule for the prefill's WRITEs (push): a cancelled request, and a failed one the prefill
may still be writing (it sent "fail", or we gave up), is reported only once the prefill has
acknowledged a ``Cancel``, which it does once none of the request's WRITEs is in flight. It gives
a stuck WRITE up ``write_timeout_s`` (its Register Ack says how long) after the Cancel, so the
Cancel waits that long plus ``rpc_timeout_s``. Without an answer by then (the prefill unreachable)
the request is reported anyway; a prefill whose port refuses connections (it died: nothing of its
can write any more) is reported at once (the wait checks the port at its first wake-up and then
every ``REPROBE_S``). Cancels have their own threads, so a long one never holds up a Register;
``close()`` ends every wait within ``WAIT_SLICE_S``.
"""
from __future__ import annotations

import logging
import queue
import socket
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

from kv_transfer import layout, offer as offers, wire
from kv_transfer.nixl import NixlAgent, device_id_of, mem_type_of

log = logging.getLogger(__name__)

WAIT_SLICE_S = 0.1  # an RPC's wait for its reply wakes this often to notice close()
REPROBE_S = 1.0  # a Cancel's wait re-checks this often that the prefill's port still listens


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
    # push
    write_timeout_s: float = 0.0  # from the Register's Ack (0: not acknowledged yet)
    refused: bool = False  # the prefill refused the Register: it never writes
    cancelling: bool = False  # failed: reported once the prefill acknowledges our Cancel


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
        self._failing: set[str] = set()  # Cancels we sent for failed push requests (report the failure)
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
        self._jobs.put((host, port, self.register_message(request_id, block_ids, first_token, num_tokens, mode)))

    def register_message(self, request_id: str, block_ids: list[int], first_token: int, num_tokens: int,
                         mode: str = "push") -> wire.Register:
        """The (unsigned) Register that asks for ``request_id``'s KV in ``block_ids`` of our caches."""
        c, a = self.caches[0], self.addressing
        return wire.Register(
            version=wire.PROTOCOL_VERSION, request_id=request_id, engine_id=self.engine_id,
            agent_name=self.engine_id, agent_metadata=self.metadata, geometry=self.geometry,
            mem_type=mem_type_of(c), device_id=device_id_of(c), layer_addrs=list(a.layer_addrs),
            block_stride=a.block_stride, head_stride=a.head_stride, token_stride=a.token_stride,
            block_ids=block_ids, first_token=first_token, num_tokens=num_tokens, transfer_mode=mode,
            nonce=b"", timestamp=0.0)

    def cancel(self, host: str, port: int, request_id: str) -> None:
        """Stop a transfer; ``poll().cancelled`` reports it once nothing can land any more."""
        with self._lock:
            r = self._recv.get(request_id)
            if r is not None and r.reading:  # a READ may be writing our blocks: wait for it; its
                r.cancelled = True           # notification frees the prefill's lease
                return
            self._recv.pop(request_id, None)
            self._failing.discard(request_id)  # (given up already: now reported as cancelled)
            self._send_cancel(host, port, request_id, r)

    def cancel_wait_s(self, r: _Recv | None) -> float:
        """How long a Cancel for ``r`` waits for the prefill's Ack: its write timeout (our own
        ``timeout_s`` while its Register is not acknowledged) plus ``rpc_timeout_s``."""
        known = r is not None and r.write_timeout_s > 0
        return (r.write_timeout_s if known else self.timeout_s) + self.rpc_timeout_s

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
                if now > r.deadline and not r.cancelling:
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
        """Fail ``r``: a pull request now, or once its READ is over (not read yet: it is cancelled
        on the prefill too, so its compute or lease ends now rather than at the lease's deadline);
        a push request the prefill may be writing once the prefill acknowledges a Cancel."""
        r.failed = r.failed or reason
        if r.reading or r.cancelling:
            return
        if r.mode == "push" and not r.refused:
            r.cancelling = True
            self._failing.add(r.request_id)
            return self._send_cancel(r.host, r.port, r.request_id, r)
        self._finish(r)
        if r.mode == "pull":
            self._quiet.add(r.request_id)
            self._send_cancel(r.host, r.port, r.request_id, r)

    def _send_cancel(self, host: str, port: int, request_id: str, r: _Recv | None) -> None:
        self._jobs.put((host, port, wire.Cancel(version=wire.PROTOCOL_VERSION, request_id=request_id,
                                                nonce=b"", timestamp=0.0), self.cancel_wait_s(r)))

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
        # pools, so that one unreachable prefill (each RPC waits up to rpc_timeout_s, a Cancel up
        # to cancel_wait_s) does not hold up registrations with the others; Cancels have their own
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-receiver-rpc") as pool, \
                ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-receiver-cancel") as cancels:
            while not self._stop.is_set():
                job = self._jobs.get()
                if job is None:
                    return
                (cancels if isinstance(job[2], wire.Cancel) else pool).submit(self._run_job, *job)

    def _run_job(self, host: str, port: int, msg, timeout_s: float | None = None) -> None:
        if self._stop.is_set():
            return  # (closing: what we hold goes away with us)
        t_sent = time.monotonic()
        try:
            sent, reply, err = self._rpc(host, port, msg, timeout_s or self.rpc_timeout_s)
        except Exception as e:  # noqa: BLE001
            sent, reply, err = msg, None, f"{type(e).__name__}: {e}"
        if isinstance(msg, wire.Cancel):
            return self._cancel_over(msg.request_id, err, host, port)
        with self._lock:
            r = self._recv.get(msg.request_id)
            if isinstance(msg, wire.Register) and r is not None:
                if not err:
                    r.write_timeout_s = reply.write_timeout_s
                elif isinstance(reply, wire.Ack) and not reply.accepted:
                    r.refused = True  # (it will not write: the failure is reported at once)
        if isinstance(msg, wire.Fetch) and not err:
            self._read(reply, sent.nonce, t_sent)
        elif err:
            with self._lock:
                r = self._recv.get(msg.request_id)
                if r is not None:
                    self._give_up(r, err)

    def _cancel_over(self, request_id: str, err: str, host: str, port: int) -> None:
        """A Cancel was acknowledged (no WRITE of the request in flight any more), or got no
        answer within its wait: report the request cancelled, or failed if we gave it up."""
        if err:
            log.warning("Cancel of %s at %s:%d: %s; reporting it over", request_id, host, port, err)
        with self._lock:
            if request_id in self._quiet:
                self._quiet.discard(request_id)
            elif request_id in self._failing:
                self._failing.discard(request_id)
                if (r := self._recv.get(request_id)) is not None:
                    self._finish(r)  # (failed)
            else:
                self._result.cancelled.add(request_id)

    def _read(self, offer: wire.Offer, nonce: bytes, t_sent: float) -> None:
        """Pull: READ what the Offer points at, telling the prefill when done."""
        with self._lock:
            r = self._recv.get(offer.request_id)
            if r is None or r.reading:
                return  # cancelled or failed meanwhile (a Cancel frees the lease)
            if why := offers.check_offer(offer, nonce, self.geometry, r.num_tokens, self.secret):
                return self._give_up(r, why)
            r.reading, r.lease_end = True, t_sent + 0.9 * offer.lease_s
        try:
            local, remote = offers.read_descs(offer, self.geometry, self.addressing, r.block_ids, r.first_token,
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

    def _rpc(self, host: str, port: int, msg, timeout_s: float) -> tuple[Any, Any, str]:
        """Send one signed message; (what was sent, the reply, '' if accepted else why not)."""
        msg = wire.sign(self.secret, msgspec.structs.replace(msg, nonce=wire.new_nonce(), timestamp=time.time()))
        sock = self._zmq.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            h = f"[{host}]" if ":" in host else host
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(f"tcp://{h}:{port}")
            sock.send(wire.encode(msg))
            if why := self._await_reply(sock, host, port, msg, timeout_s):
                return msg, None, why
            reply = wire.decode(sock.recv())
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

    def _await_reply(self, sock, host: str, port: int, msg, timeout_s: float) -> str:
        """Wait for ``sock``'s reply: '' once it is there, else why not. Gives up at
        ``timeout_s``, at ``close()``, and for a Cancel once the prefill's port refuses
        connections (a prefill that died: nothing of its can write any more), checked after the
        first ``WAIT_SLICE_S`` and then every ``REPROBE_S``."""
        deadline = time.monotonic() + timeout_s
        next_probe = time.monotonic()
        probe_s = min(self.rpc_timeout_s, REPROBE_S)  # (a silent host: the probe times out = listening)
        while not sock.poll(int(min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic())) * 1000)):
            now = time.monotonic()
            if self._stop.is_set():
                return "the receiver closed"
            if now >= deadline:
                return f"the prefill server at {host}:{port} did not answer within {timeout_s:g} s"
            if isinstance(msg, wire.Cancel) and now >= next_probe:
                if not _listening(host, port, probe_s):
                    return "nothing listens there any more"
                next_probe = time.monotonic() + REPROBE_S
        return ""


def _listening(host: str, port: int, timeout_s: float) -> bool:
    """False only if ``host`` refuses a TCP connection to ``port`` (no process listens: a prefill
    that died); an unreachable or slow host counts as listening (the Cancel's wait decides)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
    return True

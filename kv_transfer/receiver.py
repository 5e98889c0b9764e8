"""Receiving end of connector mode, independent of vLLM: owns the destination KV caches' NIXL
registration, sends authenticated ``Register``/``Cancel`` messages to prefill servers, and counts
the per-layer "done" notifications the prefill's WRITEs carry. Our vLLM connector
(``kv_transfer.vllm.connector``) wraps it; tests and benchmarks use it directly as "a decode".

Threads: ``register``/``cancel`` only queue work; one background thread does the ZMQ round trips
(so a forward never waits on the network); another drives NIXL progress every ``progress_s`` and
counts notifications. Over UCX transports that are not true RDMA (TCP, shared memory) the target
must progress for WRITEs to land, and vLLM only calls the connector once per engine step, which can
be seconds apart on a busy CPU: the progress thread makes transfer speed independent of that.
``poll()`` returns what completed, failed, or finished cancelling since the last call.
A request fails when the prefill refuses it, sends "fail", or no layer arrives for ``timeout_s``.
"""
from __future__ import annotations

import logging
import queue
from concurrent.futures import ThreadPoolExecutor
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import numpy as np  # noqa: F401  (nixl needs it importable)
import torch
import zmq

from kv_transfer import wire
from kv_transfer.nixl import NixlAgent, device_id_of, mem_type_of

log = logging.getLogger(__name__)


@dataclass
class _Recv:
    request_id: str
    num_layers: int
    deadline: float
    layers: set[int] = field(default_factory=set)
    first_layer_at: float = 0.0


@dataclass
class PollResult:
    done: set[str] = field(default_factory=set)  # every layer arrived
    failed: dict[str, str] = field(default_factory=dict)  # request id -> reason
    cancelled: set[str] = field(default_factory=set)  # Cancel acknowledged: no WRITE in flight


class PushReceiver:
    """``caches``: one tensor per layer, ``[num_blocks, H, N, 2D]`` plain pages (``wire.PLAIN_PAGE``),
    all on one device. ``geometry`` describes them."""

    def __init__(self, caches: list[torch.Tensor], geometry: wire.Geometry, secret: bytes, *,
                 engine_id: str | None = None, timeout_s: float = 120.0, rpc_timeout_s: float = 10.0,
                 progress_s: float = 0.001):
        if len(caches) != geometry.num_layers:
            raise ValueError(f"{len(caches)} caches for {geometry.num_layers} layers")
        c0 = caches[0]
        want = (geometry.num_kv_heads, geometry.block_size, 2 * geometry.head_dim)
        for c in caches:
            if tuple(c.shape[1:]) != want or c.stride(0) * c.element_size() < geometry.page_bytes:
                raise ValueError(f"cache of shape {tuple(c.shape)} is not [num_blocks, {want[0]}, "
                                 f"{want[1]}, {want[2]}] plain pages; this layout is not supported yet")
        self.caches, self.geometry, self.secret = caches, geometry, secret
        self.engine_id = engine_id or f"decode-{uuid.uuid4()}"
        self.timeout_s, self.rpc_timeout_s = timeout_s, rpc_timeout_s
        self.block_stride = c0.stride(0) * c0.element_size()
        self.agent = NixlAgent(self.engine_id, progress_thread=False)
        self.agent.register(caches)
        self.metadata = self.agent.metadata()
        self._lock = threading.Lock()
        self._recv: dict[str, _Recv] = {}
        self._result = PollResult()
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
                 num_tokens: int) -> None:
        """Ask the prefill at host:port to WRITE request_id's KV into ``block_ids``."""
        with self._lock:
            self._recv[request_id] = _Recv(request_id, self.geometry.num_layers,
                                           time.monotonic() + self.timeout_s)
        c = self.caches[0]
        reg = wire.Register(
            version=wire.PROTOCOL_VERSION, request_id=request_id, engine_id=self.engine_id,
            agent_name=self.engine_id, agent_metadata=self.metadata, geometry=self.geometry,
            mem_type=mem_type_of(c), device_id=device_id_of(c),
            layer_addrs=[t.data_ptr() for t in self.caches], block_stride=self.block_stride,
            block_ids=[int(b) for b in block_ids], first_token=first_token, num_tokens=num_tokens,
            nonce=b"", timestamp=0.0)
        self._jobs.put((host, port, reg))

    def cancel(self, host: str, port: int, request_id: str) -> None:
        """Stop a transfer; ``poll().cancelled`` reports it once no WRITE can land any more."""
        with self._lock:
            self._recv.pop(request_id, None)
        self._jobs.put((host, port, wire.Cancel(version=wire.PROTOCOL_VERSION, request_id=request_id,
                                                nonce=b"", timestamp=0.0)))

    def pending(self) -> int:
        with self._lock:
            return len(self._recv)

    def _drain(self) -> None:
        with self._agent_lock:
            try:
                notifs = self.agent.get_notifs()
            except Exception:  # noqa: BLE001 - e.g. a peer that died; timeouts catch its requests
                log.warning("NIXL notification poll failed", exc_info=True)
                return
        now = time.monotonic()
        for _agent, msg in notifs:
            parsed = wire.parse_notif(msg)
            if parsed is None:
                continue
            kind, rid, arg = parsed
            with self._lock:
                r = self._recv.get(rid)
                if r is None:
                    continue
                if kind == "fail":
                    self._recv.pop(rid)
                    self._result.failed[rid] = f"the prefill server failed: {arg}"
                    continue
                if arg.isdigit() and int(arg) < r.num_layers:
                    r.layers.add(int(arg))
                    r.first_layer_at = r.first_layer_at or now
                    r.deadline = now + self.timeout_s  # progress: the clock restarts
                if len(r.layers) == r.num_layers:
                    self._recv.pop(rid)
                    self._result.done.add(rid)

    def _progress_loop(self) -> None:
        while not self._stop.wait(self.progress_s):
            try:
                self._drain()
            except Exception:  # noqa: BLE001 - keep progressing
                log.exception("receiver progress loop error")

    def poll(self) -> PollResult:
        self._drain()
        now = time.monotonic()
        with self._lock:
            for rid, r in list(self._recv.items()):
                if now > r.deadline:
                    self._recv.pop(rid)
                    self._result.failed[rid] = (f"no KV from the prefill server for {self.timeout_s:.0f} s "
                                                f"({len(r.layers)} of {r.num_layers} layers arrived)")
            out, self._result = self._result, PollResult()
        return out

    def close(self) -> None:
        self._stop.set()
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self._progress.join(timeout=5)
        self._zmq.term()
        with self._agent_lock:
            self.agent.close()

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
        try:
            err = self._rpc(host, port, msg)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        with self._lock:
            if isinstance(msg, wire.Cancel):  # (an unreachable prefill cannot write either)
                self._result.cancelled.add(msg.request_id)
            elif err and self._recv.pop(msg.request_id, None) is not None:
                self._result.failed[msg.request_id] = err

    def _rpc(self, host: str, port: int, msg) -> str:
        """Send one signed message, wait for the Ack; '' if accepted, else why not."""
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
                ack = wire.decode(sock.recv())
            except zmq.Again:
                return f"the prefill server at {host}:{port} did not answer within {self.rpc_timeout_s:.0f} s"
        finally:
            sock.close(linger=0)
        if not isinstance(ack, wire.Ack) or ack.request_id not in (msg.request_id, ""):
            return "the prefill server sent an unexpected reply"
        if not ack.accepted:
            return f"the prefill server refused: {ack.error}"
        if ack.nonce != msg.nonce or not wire.verify(self.secret, ack):
            return "the prefill server's reply failed authentication (wrong secret?)"
        return ""

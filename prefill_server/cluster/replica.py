"""One pool worker: a Ray Serve replica holding a prefill engine behind the PrefillWorker interface,
with its own KV pool, NIXL registration and side channel, so the decode reads from (or is written
by) this worker directly; only requests, events and kv_transfer_params go through Ray.

Ray Serve calls ``check_health`` (a dead engine loop gets the replica replaced),
``record_routing_stats`` (the router's cheap view of this worker's queue and pool) and
``record_autoscaling_stats`` (queued prompt tokens, for ``autoscaling.QueuedTokensPolicy``), and
``__del__`` when the replica is removed (scale-down, rolling update, shutdown): Serve has by then
waited for its running requests, and ``__del__`` waits up to ``drain_timeout_s`` more for the
decodes to read the KV it still leases, then stops the engine.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kv_transfer.base import Route
from kv_transfer.vllm.discovery import DecodeFacts
from prefill_server.backends import backend_for
from prefill_server.cluster import messages as msg
from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.engine.worker import build_local_worker
from prefill_server.errors import PrefillError

log = logging.getLogger(__name__)
PROGRESS_INTERVAL_S = 0.25  # how often a waiting request reports where it is
HEARTBEAT_S = 1.0  # the longest a request's stream goes without an event while the worker lives
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def mark_read(f: asyncio.Future) -> None:
    """A done callback for a future no one will await: its exception counts as read (asyncio would
    log "exception was never retrieved" for a request cancelled on purpose)."""
    if not f.cancelled():
        f.exception()


@dataclass(frozen=True)
class ReplicaSpec:
    engine: EngineConfig
    server: ServerConfig
    fleet: tuple[DecodeFacts, ...]  # the decodes, as the gateway discovered them


class PrefillReplica:
    def __init__(self, spec: ReplicaSpec):
        import ray
        from ray import serve

        self.id = serve.get_replica_context().replica_id.unique_id
        self.node_ip = ray.util.get_node_ip_address()
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        host = spec.server.side_channel_host
        if host in _LOOPBACK and spec.server.pool.ray_address is not None:
            host = self.node_ip  # decodes on other machines must reach this worker's side channel
        self.side_channel_host = host
        self.drain_timeout_s = spec.server.drain_timeout_s
        self.worker = build_local_worker(spec.engine, backend_for(spec.server), spec.fleet,
                                         side_channel_host=host, side_channel_port=0)
        self.worker.start()
        self.started_at = time.time()
        log.info("prefill worker %s ready on %s (GPUs %s)", self.id, self.node_ip, self.gpu_ids or "none")

    async def run(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """One request's events (messages.py), one at least every ``HEARTBEAT_S`` (the gateway takes
        a worker silent for longer than ``pool.WORKER_SILENT_S`` as lost). A caller that goes away
        (the stream is cancelled) cancels the request here: its blocks are freed at once."""
        req = msg.request_from_dict(request)
        yield {"event": "accepted", "worker": self.id}
        ended, waits = False, []
        try:
            try:
                if req.route is Route.STREAM:
                    params, result = self.worker.start_stream(req)
                    pending = asyncio.wrap_future(params)
                    waits.append(pending)
                    while not pending.done():
                        await asyncio.wait([pending], timeout=HEARTBEAT_S)
                        if not pending.done():
                            yield {"event": "alive"}
                    yield {"event": "params", "params": pending.result()}
                else:
                    result = self.worker.submit(req)
            except PrefillError as e:
                ended = True
                yield msg.error_event(e)
                return
            fut = asyncio.wrap_future(result)
            waits.append(fut)
            last, last_sent = None, time.monotonic()
            while not fut.done():
                await asyncio.wait([fut], timeout=PROGRESS_INTERVAL_S)
                p = None if fut.done() else self.worker.progress(req.request_id)
                if p is not None and p != last:
                    last, last_sent = p, time.monotonic()
                    yield msg.progress_event(p)
                elif not fut.done() and time.monotonic() - last_sent >= HEARTBEAT_S:
                    last_sent = time.monotonic()
                    yield {"event": "alive"}
            ended = True
            if fut.exception() is not None:
                yield msg.error_event(fut.exception())
            else:
                yield {"event": "result", "result": msg.result_to_dict(fut.result())}
        finally:
            if not ended:
                self.worker.release(req.request_id)
                for w in waits:  # it ends RequestCancelled now, with no one left to read it
                    w.add_done_callback(mark_read)

    def release(self, request: dict[str, Any]) -> bool:
        return self.worker.release(str(request["request_id"]))

    def keep(self, request: dict[str, Any]) -> None:
        self.worker.keep([str(r) for r in request["request_ids"]], float(request["ttl_s"]))

    def info(self, _request: dict[str, Any] | None = None) -> dict[str, Any]:
        w = self.worker
        return {"worker": self.id, "node_ip": self.node_ip, "pid": os.getpid(), "gpu_ids": self.gpu_ids,
                "side_channel_host": self.side_channel_host, "started_at": self.started_at,
                "total_blocks": w.load().total_blocks, "block_size": w.block_size, "max_model_len": w.max_model_len,
                "cache_salt": salt.hex() if (salt := w.engine.pool.cache_salt) else None}

    def reset_prefix_cache(self, _request: dict[str, Any] | None = None) -> int:
        return self.worker.reset_prefix_cache()

    def metrics_text(self, _request: dict[str, Any] | None = None) -> bytes:
        return self.worker.render_metrics()

    def record_routing_stats(self) -> dict[str, Any]:
        return {"worker": self.id, "node_ip": self.node_ip, "pid": os.getpid(), "gpu_ids": self.gpu_ids,
                **msg.load_to_dict(self.worker.load()), "alive": self.worker.alive(), "reported_at": time.time()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queued_tokens": float(self.worker.load().pending_tokens)}

    def check_health(self) -> None:
        if not self.worker.alive():
            raise RuntimeError(f"prefill worker {self.id}: the engine loop has stopped")

    def __del__(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is None:
            return
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline:
            load = worker.load()
            if load.free_blocks == load.total_blocks and not load.waiting and not load.running:
                break
            time.sleep(0.1)  # decodes still reading leased KV
        log.info("prefill worker %s stopping", self.id)
        worker.stop()

"""The PrefillWorker interface: all that serving (the gateway, the gRPC API) and a pool of workers may
call of a prefill engine, and ``LocalWorker``, the engine in this process behind it. A remote worker
(a Ray actor) implements the same calls; nothing outside the engine touches its internals.

    submit(req)        LEASE / LEASE_FOR_LATER: a future of the PrefillResult (KV leased)
    start_stream(req)  STREAM: (future of the kv_transfer_params for the decode, at once; future of
                       the result, once every layer was written)
    release(rid)       cancel a queued or running request, or end a finished one's lease
    progress(rid)      where a request is: queued (how many ahead) or running (tokens done)
    load()             what routing needs: queued and running requests and tokens, free blocks
    alive()            the step loop runs
    not_ready()        why it cannot take requests now (readiness), [] when it can
    pool_status()      its workers and their load (GET /v1/pool; here: one, this process)
    reset_prefix_cache()  forget every cached KV block (POST /reset_prefix_cache); blocks in use stay
                       with their requests. Returns the blocks freed at once (a pool: all workers')
    refuse_room(room, why)  (LocalWorker, SGLang decodes) a refused request's room fails on its decode

The message types (``PrefillRequest``, ``SamplingParams``, ``PrefillResult``) are re-exported
here: serving imports this module and nothing else of the engine.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Protocol

from kv_transfer.base import Route
from kv_transfer.vllm.discovery import DecodeFacts
from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.engine.engine import Engine
from prefill_server.engine.prefix_cache import check_client_salt
from prefill_server.engine.sampling import MAX_LOGPROBS, SAMPLING_EPS
from prefill_server.engine.types import PrefillRequest, PrefillResult, SamplingParams, Timings, WorkerLoad
from prefill_server.metrics import Metrics

log = logging.getLogger(__name__)

__all__ = ["MAX_LOGPROBS", "SAMPLING_EPS", "LocalWorker", "PrefillRequest", "PrefillResult", "PrefillWorker",
           "Progress", "Route", "SamplingParams", "Timings", "WorkerLoad", "build_local_worker", "check_client_salt"]


@dataclass(frozen=True)
class Progress:
    state: str  # "queued" | "running"
    requests_ahead: int = 0  # queued: requests before it
    tokens_done: int = 0  # running: prompt tokens computed


class PrefillWorker(Protocol):
    metrics: Metrics  # the process's metrics (the serving layer adds its own to the same registry)

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def submit(self, req: PrefillRequest) -> Future: ...
    def start_stream(self, req: PrefillRequest) -> tuple[Future, Future]: ...
    def release(self, request_id: str) -> bool: ...
    def keep(self, request_ids: list[str], ttl_s: float) -> None:
        """Hold these requests' leased KV at least ``ttl_s`` more (``Engine.keep_leases``); ids with
        no lease (read and freed, never leased, unknown) are passed over."""
    def progress(self, request_id: str) -> Progress | None: ...
    def load(self) -> WorkerLoad: ...
    def alive(self) -> bool: ...
    def fits_whole(self, num_tokens: int) -> bool: ...
    def render_metrics(self) -> bytes: ...
    def not_ready(self) -> list[str]: ...
    def pool_status(self) -> dict: ...
    def reset_prefix_cache(self) -> int: ...
    def check_admission(self) -> None:
        """Raise ``Overloaded`` if a request arriving now would be refused: the gateway asks before it
        tokenizes, so that a full server says no at once."""


class LocalWorker(PrefillWorker):
    """The engine in this process."""

    def __init__(self, engine: Engine, loaded: build.LoadedModel | None = None):
        self.engine, self.loaded = engine, loaded  # loaded: the model (its tokenizer, config, dtype)
        self.metrics = engine.metrics
        self.max_model_len = engine.max_model_len  # the context it enforces
        self.block_size = engine.pool.block_size

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

    def submit(self, req: PrefillRequest) -> Future:
        return self.engine.submit(req)

    def start_stream(self, req: PrefillRequest) -> tuple[Future, Future]:
        result, params = self.engine.start_stream(req)
        known: Future = Future()
        known.set_result(params)
        return known, result

    def release(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def keep(self, request_ids: list[str], ttl_s: float) -> None:
        self.engine.keep_leases(request_ids, ttl_s)

    def progress(self, request_id: str) -> Progress | None:
        snap = self.engine.progress(request_id)
        if snap is None:
            return None
        state, n = snap
        return Progress(state, requests_ahead=n) if state == "queued" else Progress(state, tokens_done=n)

    def load(self) -> WorkerLoad:
        return self.engine.load()

    def alive(self) -> bool:
        return self.engine.alive()

    def fits_whole(self, num_tokens: int) -> bool:
        pool = self.engine.pool
        return pool.blocks_needed(num_tokens) <= pool.num_blocks

    def render_metrics(self) -> bytes:
        self.engine.refresh_metrics()
        return self.metrics.render()

    def not_ready(self) -> list[str]:
        return [] if self.engine.alive() else ["the engine loop has stopped"]

    def check_admission(self) -> None:
        self.engine.check_admission()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def refuse_room(self, room: int, reason: str) -> None:
        """An SGLang request for ``room`` was refused before it was submitted: its decode is told
        at once (``SGLangProducer.refuse_room``). Nothing to do for producers without rooms."""
        refuse = getattr(self.engine.producer, "refuse_room", None)
        if refuse is not None:
            refuse(room, reason)

    def pool_status(self) -> dict:
        load = self.load()
        return {"routing": None, "workers": [{"worker": "local", "outstanding_tokens": load.pending_tokens,
                                              "stats": asdict(load)}]}


def context_len(config, fleet: tuple[DecodeFacts, ...]) -> int:
    """The context enforced: the smallest of the model's and the decodes' --max-model-len."""
    return min([config.max_position_embeddings, *(f.max_model_len for f in fleet if f.max_model_len)])


def build_local_worker(ecfg: EngineConfig, backend, fleet: tuple[DecodeFacts, ...], *, side_channel_host: str,
                       side_channel_port: int) -> LocalWorker:
    """Load the model, size the pool, make the backend's producer, build and warm the engine. The
    context enforced is the smallest of the model's and the decodes' (``fleet``)."""
    m = build.load(ecfg)
    pool = build.make_pool(ecfg, m, ecfg.block_size or backend.pool_block_size(fleet))
    producer = backend.make_producer(pool, m.path, fleet, side_channel_host, side_channel_port, ecfg.lease_ttl_s)
    if m.device.type == "cpu":
        build.configure_cpu(ecfg, pool.block_size)
    stream_to = producer if Route.STREAM in producer.routes else None
    runner = build.make_runner(m, pool, ecfg.attention, stream_to=stream_to, fp8_attention=ecfg.fp8_attention)
    c = m.config
    max_model_len = context_len(c, fleet)
    engine = Engine(runner, pool, producer, max_model_len=max_model_len,
                    vocab_size=c.vocab_size, token_budget=ecfg.token_budget, max_num_seqs=ecfg.max_num_seqs,
                    max_queue_wait_s=ecfg.max_queue_wait_s, nice=ecfg.engine_nice)
    if m.device.type == "cpu" and not ecfg.cpu_threads and ecfg.warm_up_tokens:
        build.choose_cpu_threads(engine.time_forward, engine.warm_up_size(ecfg.warm_up_tokens))
    engine.warm_up(ecfg.warm_up_tokens)
    return LocalWorker(engine, m)

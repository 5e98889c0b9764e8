"""Interfaces between the prefill engine and the KV transfer backends.

A *producer* owns the path of one request's KV from the moment the engine has written it into the
KV pool until the pool gets those blocks back. Engines call it; it never calls the engine.

Lifecycle of one request's KV (``TransferState``)
-------------------------------------------------
Pull mode (stock vLLM ``NixlConnector`` compatibility, ``kv_transfer.vllm.v0_32``)::

    engine: pool.allocate() -> forward writes K/V -> producer.publish(rid, blocks, n_tokens)
                                                              |
                                                              v
        LEASED --(decode handshakes on the side channel, NIXL-READs the blocks,
           |      then sends the notification "rid:n"; after n of them)--> RELEASED
           |--(heartbeat "HB:rid,..." from a decode still queueing it) --> LEASED (extended)
           |--(lease deadline passes, no heartbeat)---------------------> EXPIRED
           '--(producer.abort(rid), e.g. the client went away)----------> ABORTED

    Ownership: until ``publish`` returns, the engine owns the blocks and frees them itself on any
    error (``publish`` raising leaves no lease behind). From ``publish`` on, the producer owns them
    through a pool lease: every end state above frees them exactly once with ``pool.release`` or
    ``pool.expire``; the engine never frees a published request. ``stop()`` releases every lease
    still held.

Streaming push mode (our own vLLM connector ``kv_transfer.vllm.connector``; ``kv_transfer.push``)::

    gateway sends the request to decode and prefill at once (engine.submit_push -> producer.expect)
        EXPECTING --(decode's connector sends a signed Register: its blocks, NIXL metadata)--> READY
        READY --(engine, layer l: K/V into staging slot l % 2, layer_done(rid, l, pages))--> SENDING
              (one NIXL WRITE per layer, notification "psv1 done rid l"; wait_layer(rid, l - 2)
               before a slot is reused)
        SENDING --(finish(rid): every WRITE DONE)--> RELEASED
        any state --(abort / Cancel from the decode / WRITE error / no Register in time)-->
              ABORTED / FAILED / EXPIRED, and a registered decode gets "psv1 fail rid reason"

    Ownership: the engine's blocks are only a staging area (two layers of the prompt); the engine
    frees them when ``finish`` or ``abort`` returns, which is only once no WRITE of the request is in
    flight, so a prompt never needs its whole KV resident at once. The decode owns its own blocks
    throughout; after a Cancel it keeps them until the prefill acknowledged.

Pull fallback in connector mode (the decode's Register asks for it; ``kv_transfer.pull``)::

    EXPECTING --(Register{transfer_mode: pull})--> READY: the engine runs the prompt like a pull-mode
        one (whole prompt in pool blocks, chunked), then producer.publish(rid, blocks, n)
    LEASED --("ready" notification; the decode fetches a signed Offer, READs, and its READ carries
        "psv1 read rid <token>")--> RELEASED;  lease deadline --> EXPIRED;  Cancel --> ABORTED

    Ownership: as in pull mode above; a prefill-side abort after the Offer went out keeps the
    blocks until that READ's notification or the deadline (the decode may be reading them).

Everything version-specific (wire formats, hashes, notification syntax) lives in one module per
pinned peer version (``kv_transfer/vllm/v0_32.py``, later ``kv_transfer/sglang/v0_5_23.py``).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable


class TransferMode(str, Enum):
    PULL = "pull"  # the decode READs leased blocks (stock vLLM NixlConnector)
    PUSH = "push"  # the prefill WRITEs into the decode's blocks, layer by layer


class TransferState(Enum):
    """Where one request's KV is. Terminal states (``is_terminal``) have given the blocks back."""

    # pull
    LEASED = "leased"          # published, blocks held under a lease until the decode has read them
    # push
    EXPECTING = "expecting"    # waiting for the decode to say where to write
    READY = "ready"            # destination known, waiting for the engine's layers
    SENDING = "sending"        # WRITEs in flight
    # terminal (blocks freed)
    RELEASED = "released"      # the decode confirmed it has the KV
    EXPIRED = "expired"        # lease or wait ran out (decode never came, or died)
    ABORTED = "aborted"        # aborted by the engine / gateway
    FAILED = "failed"          # a transfer error

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.RELEASED, TransferState.EXPIRED, TransferState.ABORTED,
                        TransferState.FAILED)


@dataclass
class ProducerStats:
    """Counters since ``start()``; names follow the Prometheus metrics the serving layer exports
    (``prefill_kv_transfer_bytes_total``, ``prefill_kv_lease_expired_total``, ...)."""

    published_total: int = 0          # requests published
    bytes_offered_total: int = 0      # bytes of KV pages put under lease (all layers)
    bytes_released_total: int = 0     # bytes of leases that ended with the decode's notification
    released_total: int = 0           # leases ended by the decode's notification
    leases_expired_total: int = 0     # leases that ran out
    aborted_total: int = 0            # leases ended by abort()
    notifications_total: int = 0      # transfer-done notifications received (valid ones)
    heartbeats_total: int = 0         # heartbeat notifications received
    bad_notifications_total: int = 0  # malformed or for unknown/expired requests (ignored)
    handshakes_total: int = 0         # side-channel metadata requests answered
    active_leases: int = 0            # gauge

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class StatsCounter:
    """Thread-safe ``ProducerStats`` holder shared by a producer's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._s = ProducerStats()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self._s, k, getattr(self._s, k) + v)

    def set(self, **values: int) -> None:
        with self._lock:
            for k, v in values.items():
                setattr(self._s, k, v)

    def snapshot(self) -> ProducerStats:
        with self._lock:
            return ProducerStats(**asdict(self._s))


class KVProducer(ABC):
    """What the engine calls once a request's KV is in the pool (pull mode).

    Thread-safety: every method may be called from the engine thread while the producer's own
    background thread serves handshakes and notifications.
    """

    mode: TransferMode = TransferMode.PULL

    @abstractmethod
    def start(self) -> None:
        """Register the pool with the transport and start serving (side channel, notifications,
        lease expiry). Idempotent."""

    @abstractmethod
    def stop(self) -> None:
        """Stop serving, release every lease still held, deregister memory. Idempotent."""

    @abstractmethod
    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> dict[str, Any]:
        """Hand the blocks holding ``num_tokens`` tokens of KV over to the producer (under a lease)
        and return the ``kv_transfer_params`` dict the decode request must carry.

        ``block_ids[t // block_size]`` holds token t. Raises ``ValueError`` (``InvalidRequest``)
        on bad input, in which case nothing was leased and the caller still owns the blocks."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """End the request's lease now and free its blocks. False if it holds none (already
        released, expired or never published)."""

    @abstractmethod
    def state(self, request_id: str) -> TransferState | None:
        """Current state, or the terminal state of a recently finished request (kept for a short
        while), or None if unknown."""

    @abstractmethod
    def stats(self) -> ProducerStats:
        """A snapshot of the counters."""

    # context-manager sugar for tests and the CLI
    def __enter__(self) -> KVProducer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@runtime_checkable
class StreamingKVProducer(Protocol):
    """Push mode (``kv_transfer.push.PushProducer``): the decode allocates and registers destination
    blocks, the prefill WRITEs each layer as soon as it is computed. The engine drives it so::

        params = producer.expect(rid, n_tokens)          # at submit; params go to the decode
        ... the scheduler waits for producer.is_ready(rid) (or fails it when producer.overdue(rid))
        for layer in range(L): ...; producer.wait_layer(rid, layer - 2); write staging;
                               producer.layer_done(rid, layer, staging_pages, cuda_event)
        producer.finish(rid)                              # all WRITEs done; then free staging
    wait_layer/finish raise at once on an abort, a Cancel, a failure or ``stop()``: the engine then
    calls ``abort(rid, reason, on_idle=free_staging)`` (WRITEs may still be in flight).
    """

    mode: TransferMode

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def expect(self, request_id: str, num_tokens: int) -> dict[str, Any]: ...
    def is_ready(self, request_id: str) -> bool: ...
    def overdue(self, request_id: str, now: float | None = None) -> str | None: ...
    def layer_done(self, request_id: str, layer: int, src_pages: Sequence[int], ready_event: Any = None) -> None: ...
    def wait_layer(self, request_id: str, layer: int, stop: Callable[[], bool] | None = None) -> None: ...
    def finish(self, request_id: str, timeout_s: float | None = None,
               stop: Callable[[], bool] | None = None) -> dict[str, Any]: ...
    def abort(self, request_id: str, reason: str = ...,
              on_idle: Callable[[], None] | None = None) -> bool: ...
    def state(self, request_id: str) -> TransferState | None: ...
    def stats(self) -> ProducerStats: ...

"""Interfaces between the prefill engine and the KV transfer backends.

A *producer* owns the path of one request's KV from the moment the engine has written it into the
KV pool until the pool gets those blocks back. Engines call it; it never calls the engine.

Lifecycle of one request's KV (``TransferState``), by ``Route`` (below)
----------------------------------------------------------------------
Route LEASE (stock vLLM ``NixlConnector`` compatibility, ``kv_transfer.vllm.nixl_compat``)::

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

Route STREAM (our own vLLM connector ``kv_transfer.vllm.connector``; ``kv_transfer.push``)::

    gateway sends the request to decode and prefill at once (engine.start_stream -> producer.expect)
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

Route STREAM_THEN_PULL, the pull fallback in connector mode (the decode's Register asks for it;
``kv_transfer.pull``), and LEASE_FOR_LATER (``producer.hold``: leased before the Register)::

    EXPECTING --(Register{transfer_mode: pull})--> READY: the engine runs the prompt like a pull-mode
        one (whole prompt in pool blocks, chunked), then producer.publish(rid, blocks, n)
    LEASED --("ready" notification; the decode fetches a signed Offer, READs, and its READ carries
        "psv1 read rid <token>")--> RELEASED;  lease deadline --> EXPIRED;  Cancel --> ABORTED

    Ownership: as in pull mode above; a prefill-side abort after the Offer went out keeps the
    blocks until that READ's notification or the deadline (the decode may be reading them).

Everything version-specific (wire formats, hashes, notification syntax) lives in one module per
pinned peer version (``kv_transfer/vllm/v0_32.py``, later ``kv_transfer/sglang/v0_5_23.py``); the
producers that speak them are apart (``kv_transfer/vllm/nixl_compat.py``).
"""
from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Protocol

from prefill_server.errors import InvalidRequest


class TransferMode(str, Enum):
    """Who moves the bytes of one transfer (the decode-side wire's word: a connector's
    ``transfer_mode`` and the Register message carry it)."""

    PULL = "pull"  # the decode READs leased blocks (stock vLLM NixlConnector; our connector's fallback)
    PUSH = "push"  # the prefill WRITEs into the decode's blocks, layer by layer


class Route(str, Enum):
    """How one request's KV leaves the engine. The request carries it from the gateway; the engine
    runs and finishes each route its own way (``Engine._finish``)::

        LEASE             computed whole into pool blocks, leased; the decode READs them
                          (nixl-compat, local). ``producer.publish``
        STREAM            each layer WRITTEN into the decode's blocks as soon as it is computed,
                          through two layers of staging (connector mode). ``producer.finish``
        STREAM_THEN_PULL  a STREAM request whose decode registered asking for the pull fallback:
                          from then on computed whole and leased to it. ``producer.publish``
        LEASE_FOR_LATER   computed first (the gateway wants the first token before it calls the
                          decode) and leased for a decode that registers later and pulls
                          (connector mode, ``--first-token prefill``). ``producer.hold``
    """

    LEASE = "lease"
    STREAM = "stream"
    STREAM_THEN_PULL = "stream-then-pull"
    LEASE_FOR_LATER = "lease-for-later"

    @property
    def registers(self) -> bool:
        """A decode registers for this request's KV with our side channel (connector mode)."""
        return self in (Route.STREAM, Route.STREAM_THEN_PULL)


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")


def check_request_id(request_id: str, field: str = "request_id") -> None:
    """The one rule for request ids, which travel in every transfer's messages and notifications:
    1-200 characters of A-Z a-z 0-9 . _ : - (what routers send, e.g. vllm-router's
    ``___prefill_addr_H:P___decode_addr_H:P_<uuid>``), not starting with ``HB:`` (vLLM's heartbeat
    notification) and without the ',' and ' ' that vLLM's and our notifications split on."""
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id) or request_id.startswith("HB:"):
        shown = request_id[:40] if isinstance(request_id, str) else type(request_id).__name__
        raise InvalidRequest(f"request id {shown!r} is not usable: send 1-200 characters of A-Z a-z 0-9 . _ : - "
                             "(not starting with 'HB:')", field=field)


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


class KVPages(Protocol):
    """What producers use of the prefill's KV pool (``prefill_server.engine.kv_pool.KVPool``): its one
    registered tensor and geometry, and leases (blocks held for a decode until it has read them)."""

    kv: Any  # the registered tensor [L, num_blocks, H, block_size, 2 * head_dim]
    num_layers: int
    num_blocks: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: Any  # torch.dtype of the pages' elements (float8_e4m3fn for FP8 pages)
    compute_dtype: Any  # torch.dtype K/V are computed in: the model's, what vLLM's hash calls dtype
    cache_dtype: str  # "auto" or "fp8_e4m3" (prefill_server.engine.kv_format)
    block_bytes: int  # one layer's page of one block

    def stores(self, cache_dtype: str) -> bool: ...  # a decode with this --kv-cache-dtype reads ours as its own

    def blocks_needed(self, num_tokens: int) -> int: ...
    def layer_base_addr(self, layer: int) -> int: ...
    def lease(self, request_id: str, block_ids: Sequence[int], ttl_s: float, num_tokens: int) -> Any: ...
    def get_lease(self, request_id: str) -> Any: ...
    def extend(self, request_id: str, ttl_s: float) -> bool: ...
    def release(self, request_id: str) -> bool: ...
    def expire(self, now: float | None = None) -> list[str]: ...


class LeaseProducer(Protocol):
    """Route LEASE (``kv_transfer.vllm.nixl_compat.NixlCompatProducer``, the engine's ``LocalProducer``):
    the engine hands over a computed request's blocks, a decode READs them.

    Thread-safety: every method may be called from the engine thread while the producer's own
    background thread serves handshakes and notifications.
    """

    routes: frozenset[Route]  # the routes it serves: {LEASE}

    def start(self) -> None:
        """Register the pool with the transport and start serving (side channel, notifications,
        lease expiry). Idempotent."""

    def stop(self) -> None:
        """Stop serving, release every lease still held, deregister memory. Idempotent."""

    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int, *,
                decode_url: str | None = None) -> dict[str, Any]:
        """Hand the blocks holding ``num_tokens`` tokens of KV (and any room the engine left past
        them) over to the producer, under a lease, and return the ``kv_transfer_params`` the
        decode request must carry (the decode at ``decode_url``: the producer's first if None). ``block_ids[t // block_size]`` holds token t. Raises
        ``ValueError`` (``InvalidRequest``) on bad input, in which case nothing was leased and the
        caller still owns the blocks."""

    def abort(self, request_id: str, reason: str = "", on_idle: Callable[[], None] | None = None) -> bool:
        """End the request's lease now and free its blocks; ``on_idle`` runs once nothing of the
        request is in flight (at once here). False if it holds none (already released, expired
        or never published)."""

    def state(self, request_id: str) -> TransferState | None:
        """Current state, or the terminal state of a recently finished request (kept for a short
        while), or None if unknown."""

    def stats(self) -> ProducerStats:
        """A snapshot of the counters."""


class StreamProducer(Protocol):
    """Routes STREAM, STREAM_THEN_PULL and LEASE_FOR_LATER (``kv_transfer.push.PushProducer``): the
    decode allocates and registers destination blocks, the prefill WRITEs each layer as soon as it
    is computed. The engine drives it so::

        params = producer.expect(rid, n_tokens[, room])  # at submit; params go to the decode
        ... the scheduler waits for producer.is_ready(rid) (or fails it when producer.overdue(rid))
        for layer in range(L): ...; producer.wait_layer(rid, layer - 2); write staging;
                               producer.layer_done(rid, layer, staging_pages, cuda_event)
        producer.finish(rid, first_token=t1, ...)         # all WRITEs done; then free staging
    wait_layer/finish raise at once on an abort, a Cancel, a failure or ``stop()``: the engine then
    calls ``abort(rid, reason, on_idle=free_staging)`` (WRITEs may still be in flight). A decode
    that asked for pull (``wants_pull``) gets the whole prompt's blocks through ``publish``; a
    request computed first is leased with ``hold``.
    """

    routes: frozenset[Route]  # {STREAM, LEASE_FOR_LATER} (STREAM_THEN_PULL follows from STREAM)

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def expect(self, request_id: str, num_tokens: int, bootstrap_room: int | None = None) -> dict[str, Any]: ...
    def is_ready(self, request_id: str) -> bool: ...
    def wants_pull(self, request_id: str) -> bool: ...
    def overdue(self, request_id: str, now: float | None = None) -> str | None: ...
    def layer_done(self, request_id: str, layer: int, src_pages: Sequence[int], ready_event: Any = None) -> None: ...
    def wait_layer(self, request_id: str, layer: int, stop: Callable[[], bool] | None = None) -> None: ...
    # first_token, logprobs, cached_tokens: for a decode that takes its first token from the prefill
    # (SGLang's aux row); our vLLM connector's decode samples its own
    def finish(self, request_id: str, timeout_s: float | None = None, stop: Callable[[], bool] | None = None, *,
               first_token: int | None = None, logprobs: Sequence[tuple[int, float]] | None = None,
               cached_tokens: int = 0) -> dict[str, Any]: ...
    def publish(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> None: ...
    def hold(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> dict[str, Any]: ...
    def abort(self, request_id: str, reason: str = "",
              on_idle: Callable[[], None] | None = None) -> bool: ...
    def state(self, request_id: str) -> TransferState | None: ...
    def stats(self) -> ProducerStats: ...


Producer = LeaseProducer | StreamProducer

"""Which worker takes a request: a Ray Serve request router, run by Serve in the gateway's process.

Policies (``--routing``):
    least-tokens  fewest outstanding prompt tokens (default): a 100K-token prompt weighs what it costs
    p2c           the lesser of two workers drawn at random (power of two choices) on the same measure
    prefix        the worker that last took the longest run of this prompt's leading blocks, unless it
                  has ``prefix_slack_tokens`` more outstanding than the least loaded (then least-tokens).
                  The blocks are named as the workers' prefix caches name them (``prefix_cache.
                  block_hashes``: the same salt of model, dtype and block size), and a cache reset
                  makes the router forget them (``forget_prefixes``)
    round-robin   in turn (the worker least recently routed to)

A worker's outstanding tokens are the larger of what this router sent it and has not seen finish,
and what the worker last reported (``PrefillReplica.record_routing_stats``, pushed by Serve every
second, stamped ``reported_at``) less the requests this router saw finish there since that report:
the router never polls a worker per request, and a report a second old does not make an idle worker
look busy. Ties go to the worker least recently routed to, counted when a request is routed (Serve
may ask ``choose_replicas`` more than once for one request: a busy replica's queue probe times out).

A worker whose last report is older than ``SILENT_S`` (hung: Serve's calls to it never return) is
ranked after every answering one, so new requests go around it until its health check removes it.

The caller passes hints in the request dict under ``"_hints"``: ``num_tokens``, ``prefix`` (block
hashes, ``prefix_hashes``), ``replica`` (this worker: a release goes where its KV is; any, if it is gone),
``avoid`` (workers not to use: a retry after one died) and ``request_id`` (``routed_to`` answers
where Serve sent it, before the worker says so itself).

Serve copies this class into the process by value: state shared with the pool lives in
``routers.LIVE``, a module Serve imports by reference.
"""
from __future__ import annotations

import itertools
import random
import time
from collections import OrderedDict, deque
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from prefill_server.cluster import routers
from prefill_server.engine.prefix_cache import block_hashes

PREFIX_BLOCKS = 128  # leading blocks hashed for prefix affinity
_PREFIX_MEMORY = 65536  # block hashes remembered (least recently used forgotten first)
_ROUTED_MEMORY = 65536  # request id -> the worker Serve sent it to (oldest forgotten first)
_FINISHED_MEMORY_S = 10.0  # finished requests kept to discount reports taken before them (pushed every 1 s)
SILENT_S = 5.0  # a worker's report this old: it is hung, or starved (Serve asks every second)


def prefix_hashes(token_ids: list[int] | tuple[int, ...], block_size: int, salt: bytes) -> list[str]:
    """The names a worker's prefix cache gives the prompt's full leading blocks (at most
    ``PREFIX_BLOCKS``), as text: the i-th names blocks 0..i."""
    return [h.hex() for h in block_hashes(token_ids, block_size, salt, limit=PREFIX_BLOCKS)]


def hints_of(req: PendingRequest | None) -> dict[str, Any]:
    if req is None or not req.args or not isinstance(req.args[0], dict):
        return {}
    return req.args[0].get("_hints") or {}


class PrefillRouter(RequestRouter):
    # Serve probes the chosen worker's queue length before sending (ours never fills: the engine
    # queues and sheds itself) and skips a worker that misses the deadline: at Serve's 0.1 s a
    # worker slow to answer on a busy CPU can lose its turns to the other. A hung one is the health check's job.
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 2.0

    def initialize_state(self, policy: str = "least-tokens", prefix_slack_tokens: int = 16384, **_: Any) -> None:
        self.policy, self.prefix_slack_tokens = policy, prefix_slack_tokens
        self._sent: dict[str, dict[str, int]] = {}  # replica id -> {internal request id: tokens}
        self._prefix: OrderedDict[str, str] = OrderedDict()  # block hash -> replica id
        self._finished: dict[str, deque[tuple[float, int]]] = {}  # replica id -> (time.time(), tokens)
        self._routed_seq: dict[str, int] = {}  # replica id -> sequence number of its last routed request
        self._routed_to: OrderedDict[str, str] = OrderedDict()  # our request id -> replica id
        self._seq = itertools.count()
        self._rng = random.Random()
        routers.LIVE.append(self)

    # ---- the view ----
    def outstanding_tokens(self, r: RunningReplica) -> int:
        rid = r.replica_id.unique_id
        sent = sum(self._sent.get(rid, {}).values())
        stats = r.routing_stats or {}
        reported = int(stats.get("pending_tokens", 0))
        if reported and (at := stats.get("reported_at")) is not None:
            reported -= sum(n for t, n in self._finished.get(rid, ()) if t >= at)
        return max(sent, reported)

    def running_ids(self) -> set[str]:
        return {rid.unique_id for rid in list(self._replicas)}

    def workers(self) -> list[dict[str, Any]]:
        """Each running worker: its id, node and last reported load."""
        return [{"worker": r.replica_id.unique_id, "node_id": r.node_id, "outstanding_tokens": self.outstanding_tokens(r),
                 "requests_routed_here": len(self._sent.get(r.replica_id.unique_id, {})), "answering": not self.silent(r),
                 "stats": dict(r.routing_stats or {})} for r in list(self._replicas.values())]

    # ---- choosing ----
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hints = hints_of(pending_request)
        if pending_request is not None:
            # Serve asks again at once, without awaiting anything, while this answers no replica and
            # the flag is off (only its locality mixins set it): its routing loop would spin and
            # starve every other request and its replica updates
            pending_request.routing_context.should_backoff = True
        if (want := hints.get("replica")) is not None:
            # a release for a worker that is gone (its leases went with it) is answered by any
            # other as "not held", rather than waiting for a worker that never comes back
            named = [r for r in candidate_replicas if r.replica_id.unique_id == want]
            return [named or list(candidate_replicas)]
        avoid = set(hints.get("avoid") or ())
        cands = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or list(candidate_replicas)
        answering = [r for r in cands if not self.silent(r)]
        if not answering:
            return [cands] if cands else []
        best = self._choose(answering, hints)
        ranks = [[best], [r for r in answering if r is not best], [r for r in cands if r not in answering]]
        return [rank for rank in ranks if rank]

    def answering(self, replica_id: str) -> bool:
        """This running worker reports its load (False: it is hung or gone)."""
        r = next((r for r in list(self._replicas.values()) if r.replica_id.unique_id == replica_id), None)
        return r is not None and not self.silent(r)

    def silent(self, r: RunningReplica) -> bool:
        """No load report from this worker for ``SILENT_S`` (a hung worker: Serve's calls to it never
        return, so a request sent there waits until the health check removes it)."""
        at = (r.routing_stats or {}).get("reported_at")
        return at is not None and time.time() - at > SILENT_S

    def _choose(self, cands: list[RunningReplica], hints: dict[str, Any]) -> RunningReplica:
        if self.policy == "round-robin":
            return self._least_recent(cands)
        if self.policy == "p2c" and len(cands) > 2:
            cands = self._rng.sample(cands, 2)
        least = self._least(cands)
        if self.policy == "prefix" and (held := self._holder(cands, hints.get("prefix") or [])) is not None:
            if self.outstanding_tokens(held) - self.outstanding_tokens(least) <= self.prefix_slack_tokens:
                return held
        return least

    def _least(self, cands: list[RunningReplica]) -> RunningReplica:
        loads = [self.outstanding_tokens(r) for r in cands]  # (each sums the worker's recent finishes)
        low = min(loads)
        return self._least_recent([r for r, n in zip(cands, loads) if n == low])

    def _least_recent(self, cands: list[RunningReplica]) -> RunningReplica:
        return min(cands, key=lambda r: (self._routed_seq.get(r.replica_id.unique_id, -1), r.replica_id.unique_id))

    def _holder(self, cands: list[RunningReplica], hashes: list[str]) -> RunningReplica | None:
        """The candidate that took the longest run of these leading blocks."""
        by_id = {r.replica_id.unique_id: r for r in cands}
        for h in reversed(hashes):
            if (rid := self._prefix.get(h)) in by_id:
                return by_id[rid]
        return None

    # ---- bookkeeping ----
    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        if pending_request.metadata.call_method != "run":
            return
        hints = hints_of(pending_request)
        rid = replica_id.unique_id
        self._sent.setdefault(rid, {})[pending_request.metadata.internal_request_id] = int(hints.get("num_tokens", 0))
        self._routed_seq[rid] = next(self._seq)
        if (req_id := hints.get("request_id")) is not None:
            self._routed_to[req_id] = rid
            while len(self._routed_to) > _ROUTED_MEMORY:
                self._routed_to.popitem(last=False)
        for h in hints.get("prefix") or ():
            self._prefix[h] = rid
            self._prefix.move_to_end(h)
        while len(self._prefix) > _PREFIX_MEMORY:
            self._prefix.popitem(last=False)

    def routed_to(self, request_id: str) -> str | None:
        """The worker Serve last sent this request to (it may not have said "accepted" yet)."""
        return self._routed_to.get(request_id)

    def forget_prefixes(self) -> None:
        """The workers' prefix caches were reset: no worker holds any block now."""
        self._prefix.clear()

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        tokens = self._sent.get(replica_id.unique_id, {}).pop(internal_request_id, None)
        if tokens:
            now = time.time()  # wall clock: compared with the worker's reported_at, maybe on another node
            done = self._finished.setdefault(replica_id.unique_id, deque())
            done.append((now, tokens))
            while done and done[0][0] < now - _FINISHED_MEMORY_S:
                done.popleft()

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        for book in (self._sent, self._finished, self._routed_seq):
            book.pop(replica_id.unique_id, None)

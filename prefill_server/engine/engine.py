"""The prefill engine: one thread runs ``schedule -> forward -> sample -> publish KV -> release``.

Request lifecycle (who frees what):

    submit ──> WAITING ──(pool holds the whole prompt)──> RUNNING (chunks over several steps)
       │          │  queue wait > max_queue_wait_s: fail, nothing allocated (PoolExhausted when
       │          │  the pool held it up, Overloaded when compute did)
       │          │  abort: removed, nothing allocated
       │  the prompt tokens ahead would hold it up past max_queue_wait_s at the measured
       │  throughput: refused at once (Overloaded, with a retry-after)
                  v
    RUNNING ──(last chunk computed)──> first token sampled ──> producer.publish(blocks)
                  │  forward raises / abort: blocks freed here, future fails
                  v
    PUBLISHED: the blocks belong to a pool lease keyed by request id. The producer frees them when
               the decode says it has read them, when the lease expires (no reader, no heartbeat),
               or on ``release``/``abort`` (client gave up, decode call failed).

Push (connector mode, ``submit_push``): the producer is told at submit (``expect``) and returns the
``kv_transfer_params`` for the decode; the request WAITS until its decode has registered its
destination blocks (or fails after the producer's register timeout), then runs whole in one step on
staging blocks; every layer is WRITTEN to the decode as soon as it is computed. ``producer.finish``
waits for the last WRITE, then the engine frees the staging blocks. On any failure or abort the
engine calls ``producer.abort`` and frees them only when the producer calls back (``on_idle``):
no WRITE reads them any more (at once in the usual case; a WRITE still in flight to a dead decode
holds them until it is done or the producer's transfer timeout gives it up, while the engine
goes on serving). ``producer.abort`` is never called with the engine lock held. An abort while
the forward runs stops it at the next layer (the runner checks ``Sequence.abort_requested``),
not at the end of the prompt, and one while the forward or ``finish`` waits for a WRITE stops
that wait at once (``stop=``): a WRITE stuck on a dead decode never holds up the loop. If the
decode registered asking for the pull fallback (``producer.wants_pull``), the request runs like a
pull-mode one (whole prompt in the pool, chunked) and ``producer.publish`` leases its blocks to the
decode, which READs them (``kv_transfer.pull``).

Computed first (connector mode, a ``pull_later`` request): the gateway wants the first token
before it calls the decode. The request runs at once like an ordinary one (it waits for no Register) and
``producer.hold`` leases its blocks; the result's ``kv_transfer_params`` send the decode to pull
them (``transfer_mode`` "pull", ``num_tokens``). The lease ends when the decode has read them, at
its deadline, or on ``abort``.

The engine never frees leased blocks itself; the producer never frees running blocks. A failed step
fails only the requests in that step and the loop keeps serving.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future

import torch

from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.runner import ModelRunner
from prefill_server.engine.sampling import MAX_LOGPROBS, first_token_logprobs, sample_first_token
from prefill_server.engine.scheduler import Scheduler, Sequence
from prefill_server.engine.types import PrefillRequest, PrefillResult, Timings
from prefill_server.engine.throughput import ThroughputMeter
from prefill_server.errors import (InvalidRequest, Overloaded, PoolExhausted, PromptTooLong, RequestCancelled,
                                   TransferError)
from prefill_server.metrics import Metrics

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, runner: ModelRunner, pool: KVPool, producer, *, max_model_len: int,
                 vocab_size: int, token_budget: int, max_num_seqs: int, max_queue_wait_s: float,
                 metrics: Metrics | None = None):
        self.runner, self.pool, self.producer = runner, pool, producer
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.scheduler = Scheduler(pool, token_budget, max_num_seqs, max_queue_wait_s,
                                   push_ready=getattr(producer, "is_ready", None),
                                   wants_pull=getattr(producer, "wants_pull", None))
        self.supports_push = hasattr(producer, "expect")
        runner.producer = producer if self.supports_push else None
        self.metrics = metrics or Metrics()
        self.metrics.blocks_total.set(pool.num_blocks)
        pool.on_lease_end = self._lease_ended
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._aborts: set[str] = set()
        self._finishing: dict[str, Sequence] = {}  # push requests computed, in producer.finish
        self._expired_seen = 0
        self.throughput = ThroughputMeter()

    # ---- lifecycle ----
    def start(self) -> None:
        self.producer.start()
        self._thread = threading.Thread(target=self._loop, name="prefill-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread:
            self._thread.join(timeout=30)
        self.producer.stop()

    def alive(self) -> bool:
        """The step loop runs (liveness; readiness also needs it)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop

    # ---- API (any thread) ----
    def validate(self, req: PrefillRequest) -> None:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty: send at least one token", field="prompt")
        if n > self.max_model_len:
            raise PromptTooLong(f"the prompt has {n} tokens, more than the model's context of "
                                f"{self.max_model_len}: shorten it", field="prompt")
        ids = req.prompt_token_ids
        if min(ids) < 0 or max(ids) >= self.vocab_size:  # (C-speed; the list only when one is bad)
            bad = [t for t in ids if not (0 <= t < self.vocab_size)]
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                 field="prompt")
        req.sampling.validate()
        if req.num_logprobs is not None and not 0 <= req.num_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}", field="logprobs")
        if req.push and not self.supports_push:
            raise InvalidRequest("this server's transfer mode does not stream KV (push); start it "
                                 "with --transfer-mode connector", field="transfer_mode")
        if req.pull_later and (req.push or not self.supports_push):
            raise InvalidRequest("pull_later needs a connector-mode server (--transfer-mode connector) "
                                 "and a request that does not also ask for push", field="transfer_mode")
        if not req.push and not req.pull_later and self.supports_push:
            raise InvalidRequest("this server runs in connector mode (streaming push): a prefill must "
                                 "come with its decode request (HTTP gateway), not on its own",
                                 field="transfer_mode")
        if req.room_tokens and (req.push or req.room_tokens < 0):
            raise InvalidRequest("room_tokens applies to requests whose KV is leased, not streamed",
                                 field="room_tokens")
        self.scheduler.check_fits(n + req.room_tokens, req.push)

    def submit(self, req: PrefillRequest) -> Future:
        """Queue a prefill; the future resolves to a PrefillResult. Raises InvalidRequest at once.
        A ``pull_later`` request (connector mode) resolves once its KV is leased: its
        ``kv_transfer_params`` send the decode to pull the first ``num_tokens`` prompt tokens;
        ``abort`` frees the lease at once, and unread it expires after the producer's lease time."""
        return self._submit(req)[0]

    def submit_push(self, req: PrefillRequest) -> tuple[Future, dict]:
        """Queue a streamed prefill (``req.push``); returns (future, kv_transfer_params for the
        decode). Send the decode its request right away: the prefill starts once it registers."""
        assert req.push
        return self._submit(req)

    def _submit(self, req: PrefillRequest) -> tuple[Future, dict | None]:
        self.validate(req)
        fut: Future = Future()
        with self._wake:
            if self.scheduler.find(req.request_id) or self.pool.get_lease(req.request_id):
                raise InvalidRequest(f"request id {req.request_id!r} is already in use", field="request_id")
            self._admit(req)
            seq = Sequence(req, fut)
            if req.push:
                seq.params = self.producer.expect(req.request_id, seq.num_tokens)
            self.scheduler.add(seq)
            self.metrics.queue_depth.set(self.scheduler.num_waiting)
            self._wake.notify_all()
        return fut, seq.params

    def _admit(self, req: PrefillRequest) -> None:  # lock held
        """Shed a request that could not start within the queue deadline at the measured rate."""
        rate = self.throughput.tokens_per_s()
        if rate is None:
            return
        ahead = self.scheduler.pending_tokens()
        wait_s = ahead / rate
        if wait_s <= self.scheduler.max_queue_wait_s:
            return
        retry_s = math.ceil(wait_s - self.scheduler.max_queue_wait_s)
        raise Overloaded(f"the prefill queue is full: {ahead} prompt tokens in {self.scheduler.num_waiting} "
                         f"waiting and {len(self.scheduler.running)} running requests are ahead of this one, "
                         f"about {wait_s:.0f} s at the measured {rate:.0f} tokens/s, more than the "
                         f"{self.scheduler.max_queue_wait_s:g} s a request may wait to start "
                         f"(--max-queue-wait): retry in {retry_s} s", retry_after_s=retry_s)

    def _timed_out(self, seq: Sequence) -> Exception:  # lock held
        """Why a sequence waited past the queue deadline: the pool or compute."""
        waited = time.monotonic() - seq.t_submit
        limit = self.scheduler.max_queue_wait_s
        pool = self.pool
        if self.scheduler.blocked_on_kv:
            return PoolExhausted(
                f"waited {waited:.0f} s (--max-queue-wait {limit:g}) for KV blocks: the prompt needs "
                f"{self.scheduler.blocks_for(seq)}, {pool.num_free} of {pool.num_blocks} are free and the "
                f"rest are held by running prompts and {pool.num_leases} leases awaiting their decodes' "
                f"reads; retry later, or give the server a larger pool (--kv-cache-gib)",
                retry_after_s=max(1, math.ceil(limit / 4)))
        return Overloaded(
            f"waited {waited:.0f} s (--max-queue-wait {limit:g}) for compute: "
            f"{self.scheduler.pending_tokens()} prompt tokens are queued or running ({pool.num_free} of "
            f"{pool.num_blocks} KV blocks free); retry later, or add prefill capacity",
            retry_after_s=max(1, math.ceil(limit / 4)))

    def abort(self, request_id: str) -> bool:
        """Cancel a queued/running request or release a finished one's KV. True if anything was freed."""
        with self._wake:
            seq = self.scheduler.find(request_id)
            if seq is not None:
                self._aborts.add(request_id)  # the loop removes it between steps
                seq.abort_requested = True  # and a streamed forward stops at its next layer
                self._wake.notify_all()
                return True
            if (seq := self._finishing.get(request_id)) is not None:
                seq.abort_requested = True  # its finish stops waiting; _finish aborts the push
                return True
        return bool(self.producer.abort(request_id))

    # ---- the loop ----
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.scheduler.has_work():
                    self._wake.wait(timeout=0.5)
                stop = self._stop
                if stop:
                    failed = [(seq, RequestCancelled("server shutting down"), self._detach(seq))
                              for seq in list(self.scheduler.running) + list(self.scheduler.waiting)]
                else:
                    failed = self._apply_aborts()
                    chunks, timed_out = self.scheduler.schedule()
                    failed += [(seq, self._timed_out(seq), []) for seq in timed_out]  # (not scheduled: no blocks)
            for seq, err, blocks in failed:  # (without the lock: an abort may wait for WRITEs)
                self._fail(seq, err, blocks)
            if stop:
                return
            if not chunks:
                time.sleep(0.005)  # waiting for leases to end
                continue
            self.step(chunks)

    def step(self, chunks) -> None:
        try:
            if chunks[0].seq.push and not self.producer.is_ready(chunks[0].seq.request_id):
                raise self._push_error(chunks[0].seq)  # the decode went away after registering
            t0 = time.monotonic()
            logits = self.runner.run(chunks)
            self.throughput.record(sum(c.end - c.start for c in chunks), time.monotonic() - t0)
        except Exception as e:  # a failed forward fails its requests only
            if isinstance(e, RequestCancelled):  # an abort stopped a streamed forward
                log.info("forward stopped: %s", e)
            else:
                log.exception("forward failed for %d chunk(s)", len(chunks))
            with self._wake:
                blocks = [self._detach(c.seq) for c in chunks]
            for c, b in zip(chunks, blocks):
                self._fail(c.seq, e, b)
            return
        with self._wake:
            done = self.scheduler.advance(chunks)
            self._finishing.update((s.request_id, s) for s in done if s.push)
        for i, seq in enumerate(done):
            try:
                self._finish(seq, logits[i])
            finally:
                with self._wake:
                    self._finishing.pop(seq.request_id, None)
        self.refresh_metrics()

    def _finish(self, seq: Sequence, logits: torch.Tensor) -> None:
        req = seq.request
        try:
            token = sample_first_token(logits, req.sampling)
            logprobs = None if req.num_logprobs is None else first_token_logprobs(logits, token, req.num_logprobs)
            if seq.push:  # every layer's WRITE done; an abort meanwhile stops the wait at once
                self.producer.finish(req.request_id, stop=lambda: seq.abort_requested)
                blocks, seq.block_ids = seq.block_ids, []
                self.pool.free(blocks)  # staging only; the KV is in the decode's blocks now
                params = seq.params
            elif seq.pull:  # the decode READs the leased blocks (publish raising leases nothing)
                self.producer.publish(req.request_id, seq.block_ids, seq.num_tokens)
                seq.block_ids, params = [], seq.params
            elif req.pull_later:  # leased for a decode that registers later (hold raising leases nothing)
                params = self.producer.hold(req.request_id, seq.block_ids, seq.num_tokens)
                seq.block_ids = []
            else:
                blocks, seq.block_ids = seq.block_ids, []
                params = self.producer.publish(req.request_id, blocks, seq.num_tokens)
        except Exception as e:
            log.exception("publishing KV failed for %s", req.request_id)
            self._fail(seq, e)
            return
        now = time.monotonic()
        t0 = seq.t_first_scheduled or now
        timings = Timings(queued_s=t0 - seq.t_submit, prefill_s=now - t0, total_s=now - seq.t_submit)
        m = self.metrics
        m.ttft.observe(timings.total_s)
        m.prefill_time.observe(timings.prefill_s)
        m.queue_time.observe(timings.queued_s)
        m.prompt_tokens.inc(seq.num_tokens)
        m.kv_bytes.inc(self.pool.blocks_needed(seq.num_tokens) * self.pool.block_bytes * self.pool.num_layers)
        m.prefills.labels("ok").inc()
        result = PrefillResult(req.request_id, token, seq.num_tokens, 0, params, timings, logprobs)
        if not seq.future.set_running_or_notify_cancel():
            self.producer.abort(req.request_id)  # the caller went away: free at once
            return
        seq.future.set_result(result)

    def _detach(self, seq: Sequence) -> list[int]:  # lock held
        """Take a failing sequence out of the scheduler (it is never scheduled again); returns its
        blocks, for ``_fail`` to free."""
        blocks, seq.block_ids = seq.block_ids, []
        self.scheduler.remove(seq)
        return blocks

    def _fail(self, seq: Sequence, err: BaseException, blocks: list[int] | None = None) -> None:
        """Fail a sequence. Never call it with the engine lock held: a push abort may wait (at most
        the producer's abort_wait_s) for in-flight WRITEs. ``blocks``: from ``_detach`` (None: the
        sequence is detached here). Connector mode: the producer calls back once no WRITE reads
        the blocks, and they are freed then; the future fails after that unless a WRITE was still
        in flight when the abort returned (then at once: the blocks follow when it is over)."""
        if blocks is None:
            with self._wake:
                blocks = self._detach(seq)
        free = self._freer(blocks)
        if seq.connector:  # no WRITE may still read the staging blocks when freed; the decode is told
            try:
                self.producer.abort(seq.request_id, f"prefill failed: {err}", on_idle=free)
            except Exception:  # noqa: BLE001 - the producer bounds its waits; never stop the loop
                log.exception("push abort of %s failed", seq.request_id)
                free()
        else:
            free()
        self.metrics.prefills.labels(type(err).__name__).inc()
        if not seq.future.done():
            if seq.future.set_running_or_notify_cancel():
                seq.future.set_exception(err)

    def _freer(self, blocks: list[int]):
        """A callable that frees ``blocks`` on its first call only (from any thread)."""
        held = [blocks]

        def free() -> None:
            try:
                ids = held.pop()
            except IndexError:
                return
            if ids:
                self.pool.free(ids)
        return free

    def _apply_aborts(self) -> list[tuple[Sequence, BaseException, list[int]]]:  # called with the lock held
        """Detach the aborted, cancelled and overdue sequences; the caller fails them (``_fail``)
        once it has let go of the lock."""
        failed: list[tuple[Sequence, BaseException, list[int]]] = []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.future.cancelled():  # the caller went away (client disconnect, deadline)
                self._aborts.add(seq.request_id)
        for rid in list(self._aborts):
            seq = self.scheduler.find(rid)
            if seq is not None:
                failed.append((seq, RequestCancelled(f"request {rid} was aborted"), self._detach(seq)))
        self._aborts.clear()
        pulled = [s for s in self.scheduler.running if s.pull]  # (its decode may have cancelled)
        for seq in list(self.scheduler.waiting) + pulled:
            if seq.connector and (why := self.producer.overdue(seq.request_id)):
                failed.append((seq, self._push_error(seq, why), self._detach(seq)))
        return failed

    def _push_error(self, seq: Sequence, why: str | None = None) -> Exception:
        why = why or self.producer.overdue(seq.request_id) or "the decode's registration was lost"
        return TransferError(f"request {seq.request_id}: {why}")

    def _lease_ended(self, lease, expired: bool) -> None:
        """Pull mode: a lease ends when the decode has read the KV (or gave up / expired)."""
        if not expired:
            self.metrics.kv_transfer_time.observe(time.monotonic() - lease.created_at)
        else:
            self.metrics.kv_failed.inc()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.blocks_in_use.set(self.pool.num_used)
        m.queue_depth.set(self.scheduler.num_waiting)
        m.running.set(len(self.scheduler.running))
        expired = self.pool.expired_total
        if expired > self._expired_seen:
            m.lease_expired.inc(expired - self._expired_seen)
            self._expired_seen = expired

    def refresh_metrics(self) -> None:
        """Bring gauges up to date (called after each step and on every /metrics scrape)."""
        self._update_gauges()

"""The prefill engine: one thread runs ``schedule -> forward -> sample -> hand the KV over -> release``.

Why this file is long: the step loop, the hand-over of each route and the failure paths share the
engine lock and one request lifecycle (below); split apart, that lifecycle would be read across files.

Request lifecycle (who frees what):

    submit ──> WAITING ──(pool holds the whole prompt)──> RUNNING (chunks over several steps)
       │          │  queue wait > max_queue_wait_s: fail, nothing allocated (PoolExhausted when
       │          │  the pool held it up, Overloaded when compute did)
       │          │  abort: removed, nothing allocated
       │  the prompt tokens ahead would hold it up past max_queue_wait_s at the measured
       │  throughput: refused at once (Overloaded, with a retry-after)
                  v
    RUNNING ──(last chunk computed)──> first token sampled ──> the KV handed over, per route
                  │  forward raises / abort: blocks freed here, future fails
                  v
    HANDED OVER: leased blocks belong to a pool lease keyed by request id; the producer frees them
               when the decode says it has read them, when the lease expires (no reader, no
               heartbeat), or on ``release``/``abort`` (client gave up, decode call failed).

How the KV is handed over is the request's ``Route`` (``kv_transfer.base``), one handler each in
``_finish``:

- LEASE (nixl-compat, local): ``producer.publish`` leases the blocks; the decode READs them.
- STREAM (connector mode, ``start_stream``): the producer is told at submit (``expect``) and
  returns the ``kv_transfer_params`` for the decode; the request WAITS until its decode has
  registered its destination blocks (or fails after the producer's register timeout), then runs
  whole in one step on staging blocks; every layer is WRITTEN to the decode as soon as it is
  computed. ``producer.finish`` waits for the last WRITE, then the engine frees the staging blocks.
- STREAM_THEN_PULL: a STREAM request whose decode registered asking for the pull fallback
  (``producer.wants_pull``) runs like a LEASE one (whole prompt in the pool, chunked) and
  ``producer.publish`` leases its blocks to the decode, which READs them (``kv_transfer.pull``).
- LEASE_FOR_LATER (connector mode, computed first): the gateway wants the first token before it
  calls the decode. The request runs at once like a LEASE one (it waits for no Register) and
  ``producer.hold`` leases its blocks; the result's ``kv_transfer_params`` send the decode to pull
  them. The lease ends when the decode has read them, at its deadline, or on ``abort``.

On any failure or abort the engine calls ``producer.abort`` and frees the request's blocks only
when the producer calls back (``on_idle``): no WRITE reads them any more (at once in the usual case;
a WRITE still in flight to a dead decode holds them until it is done or the producer's transfer
timeout gives it up, while the engine goes on serving). ``producer.abort`` is never called with the
engine lock held. An abort while a STREAM forward runs stops it at the next layer (the runner checks
``Sequence.abort_requested``), and one while the forward or ``finish`` waits for a WRITE stops that
wait at once (``stop=``): a WRITE stuck on a dead decode never holds up the loop.

The engine never frees leased blocks itself; the producer never frees running blocks. A failed step
fails only the requests in that step and the loop keeps serving.

Prefix cache (``--prefix-cache``): blocks are counted references (``kv_pool.py``); the scheduler
starts a prompt after its cached head, and the blocks handed over are the whole prompt's, cached
and new alike (the decode READs both). ``PrefillResult.num_cached_tokens`` says how many tokens
were found cached.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future

import torch

from kv_transfer.base import Producer, Route, check_request_id
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.prefix_cache import check_client_salt
from prefill_server.engine.priority import lower_thread_priority
from prefill_server.engine.runner import ModelRunner
from prefill_server.engine.sampling import MAX_LOGPROBS, first_token_logprobs, sample_first_token
from prefill_server.engine.scheduler import Chunk, Scheduler, Sequence, prompt_hashes
from prefill_server.engine.types import PrefillRequest, PrefillResult, Timings, WorkerLoad
from prefill_server.engine.throughput import ThroughputMeter
from prefill_server.errors import (InvalidRequest, Overloaded, PoolExhausted, PromptTooLong, RequestCancelled,
                                   TransferError)
from prefill_server.metrics import Metrics

log = logging.getLogger(__name__)

_ROUTE_REFUSALS = {
    Route.STREAM: "this server's transfer mode does not stream KV (push); start it with --transfer-mode connector",
    Route.LEASE_FOR_LATER: "a request computed before its decode registers needs a connector-mode server "
                           "(--transfer-mode connector)",
    Route.LEASE: "this server streams KV into its decodes as it is computed (connector mode, or SGLang decodes): "
                 "a prefill must come with its decode request (the HTTP gateway, or an SGLang router's "
                 "bootstrap_room), not on its own",
    Route.STREAM_THEN_PULL: "stream-then-pull is where a STREAM request goes when its decode asks: send STREAM",
}


class Engine:
    def __init__(self, runner: ModelRunner, pool: KVPool, producer: Producer, *, max_model_len: int,
                 vocab_size: int, token_budget: int, max_num_seqs: int, max_queue_wait_s: float,
                 metrics: Metrics | None = None, nice: int = 0):
        self.runner, self.pool, self.producer = runner, pool, producer
        self.nice = nice  # the step loop's thread runs at this nice (lower_thread_priority)
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        streams = Route.STREAM in producer.routes
        assert streams == (runner.stream_to is producer), "give the runner the producer that streams"
        self.scheduler = Scheduler(pool, token_budget, max_num_seqs, max_queue_wait_s,
                                   stream=producer if streams else None)
        self.metrics = metrics or Metrics()
        self.metrics.blocks_total.set(pool.num_blocks)
        self.scheduler.on_lookup = self._count_lookup
        pool.on_lease_end = self._lease_ended
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._aborts: set[str] = set()
        self._finishing: dict[str, Sequence] = {}  # requests computed, their KV being handed over
        self._expired_seen = 0
        self._evictions_seen = self._restored_seen = 0
        self.throughput = ThroughputMeter()
        self._warn_if_pool_short(streams)

    def _warn_if_pool_short(self, streams: bool) -> None:
        """A pool that cannot hold the model's longest prompt serves, but refuses those prompts (400):
        say so at start, not at the first long request."""
        needed = self.scheduler.blocks_for(self.max_model_len, streams)
        if needed > self.pool.num_blocks:
            log.warning("the KV pool has %d blocks of %d tokens; a prompt of the model's full context (%d tokens) "
                        "needs %d: longer prompts than the pool holds will be refused with 400; raise "
                        "--kv-cache-gib or --num-kv-blocks to serve them", self.pool.num_blocks,
                        self.pool.block_size, self.max_model_len, needed)

    # ---- lifecycle ----
    def warm_up(self, num_tokens: int) -> float | None:
        """Two forwards of ``num_tokens`` placeholder tokens on borrowed pool blocks, before
        serving: the first pays the one-time costs (weights paged in, kernels chosen or compiled)
        that the first request would pay otherwise; the second measures the throughput admission
        needs from the first request on (otherwise every request that arrives during the first
        step is admitted blind). Returns the measured forward's seconds (None if nothing ran)."""
        n = self.warm_up_size(num_tokens)
        if n <= 0:
            return None
        times = [self.time_forward(n) for _ in range(2)]
        self.throughput.record(n, times[1])
        log.info("warm-up: %d tokens, first forward %.2f s, then %.2f s (%.0f tokens/s)", n, times[0],
                 times[1], n / times[1])
        return times[1]

    def warm_up_size(self, num_tokens: int) -> int:
        """Placeholder tokens a warm-up forward can take: at most a step's budget and the pool."""
        return min(num_tokens, self.scheduler.token_budget, self.max_model_len,
                   self.pool.num_blocks * self.pool.block_size)

    def time_forward(self, num_tokens: int) -> float:
        """Seconds of one forward of ``num_tokens`` placeholder tokens on borrowed pool blocks
        (before ``start``: the step loop is not running)."""
        assert self._thread is None and 0 < num_tokens <= self.warm_up_size(num_tokens)
        seq = Sequence(PrefillRequest("warm-up", (0,) * num_tokens), Future())
        seq.block_ids = self.pool.allocate(self.pool.blocks_needed(num_tokens))
        try:
            t0 = time.monotonic()
            self.runner.run([Chunk(seq, 0, num_tokens)])
            self._synchronize()
            return time.monotonic() - t0
        finally:
            self.pool.free(seq.block_ids)

    def _synchronize(self) -> None:
        """Wait for the device's queued work, so that a step's time is its compute, not its launch."""
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)

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
            raise PromptTooLong(f"the prompt has {n} tokens, more than the {self.max_model_len} served here (the "
                                "model's context, or the decode's --max-model-len if smaller): shorten it",
                                field="prompt")
        ids = req.prompt_token_ids
        if min(ids) < 0 or max(ids) >= self.vocab_size:  # (C-speed; the list only when one is bad)
            bad = [t for t in ids if not (0 <= t < self.vocab_size)]
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                 field="prompt")
        req.sampling.validate()
        check_client_salt(req.cache_salt)
        if req.num_logprobs is not None and not 0 <= req.num_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}", field="logprobs")
        check_request_id(req.request_id)
        if req.route not in self.producer.routes:
            raise InvalidRequest(_ROUTE_REFUSALS.get(req.route, f"this server takes no {req.route.value} "
                                                     "requests"), field="transfer_mode")
        streams = req.route is Route.STREAM
        if req.room_tokens and (streams or req.room_tokens < 0):
            raise InvalidRequest("room_tokens applies to requests whose KV is leased, not streamed",
                                 field="room_tokens")
        self.scheduler.check_fits(n + req.room_tokens, streams, req.room_tokens)

    def submit(self, req: PrefillRequest) -> Future:
        """Queue a LEASE or LEASE_FOR_LATER prefill; the future resolves to a PrefillResult once its
        KV is leased (its ``kv_transfer_params`` send the decode to it; ``abort`` frees the lease at
        once, and unread it expires after the producer's lease time). Raises InvalidRequest at once."""
        assert req.route is not Route.STREAM, "a STREAM request starts with start_stream"
        return self._submit(req)[0]

    def start_stream(self, req: PrefillRequest) -> tuple[Future, dict]:
        """Queue a STREAM prefill; returns (future, kv_transfer_params for the decode). Send the
        decode its request right away: the prefill starts once it registers."""
        assert req.route is Route.STREAM
        return self._submit(req)

    def _submit(self, req: PrefillRequest) -> tuple[Future, dict | None]:
        self.validate(req)
        fut: Future = Future()
        hashes = None  # (hashed here, outside the lock: a 128K-token prompt takes milliseconds)
        if self.pool.cache is not None:
            hashes = prompt_hashes(self.pool, req)
        with self._wake:
            if self.scheduler.find(req.request_id) or self.pool.get_lease(req.request_id):
                raise InvalidRequest(f"request id {req.request_id!r} is already in use", field="request_id")
            self._admit()
            seq = Sequence(req, fut, block_hashes=hashes)
            if req.route is Route.STREAM:
                seq.params = self.producer.expect(req.request_id, seq.num_tokens, req.bootstrap_room)
            self.scheduler.add(seq)
            self.metrics.queue_depth.set(self.scheduler.num_waiting)
            self._wake.notify_all()
        return fut, seq.params

    def progress(self, request_id: str) -> tuple[str, int] | None:
        """("queued", requests ahead) | ("running", tokens computed) | None (not queued or running)."""
        with self._wake:
            for i, seq in enumerate(self.scheduler.waiting):
                if seq.request_id == request_id:
                    return "queued", i
            for seq in self.scheduler.running:
                if seq.request_id == request_id:
                    return "running", seq.num_computed
        return None

    def load(self) -> WorkerLoad:
        """What routing needs."""
        with self._wake:
            s = self.scheduler
            return WorkerLoad(waiting=s.num_waiting, running=len(s.running), pending_tokens=s.pending_tokens(),
                              free_blocks=self.pool.num_free, total_blocks=self.pool.num_blocks,
                              block_size=self.pool.block_size, tokens_per_s=self.throughput.tokens_per_s())

    def check_admission(self) -> None:
        """Raise ``Overloaded`` now if the queue ahead would keep a new request past its deadline.
        Without the lock, from the scheduler's last published count: a full server answers at once
        even while the compute thread holds the lock (``submit`` checks again under it)."""
        self._admit(self.scheduler.queued_tokens)

    def _admit(self, ahead: int | None = None) -> None:  # lock held, unless ahead is given
        """Shed a request that could not start within the queue deadline at the measured rate (the
        prompt tokens ahead of it decide, not its own)."""
        rate = self.throughput.tokens_per_s()
        if rate is None:
            return
        if ahead is None:
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
                seq.abort_requested = True  # its hand-over stops (a push) or is undone (a lease)
                if seq.streams:
                    return True
        # (a lease published already, its caller answered, is freed here; one not yet, by _finish)
        return bool(self.producer.abort(request_id)) or seq is not None

    def keep_leases(self, request_ids: list[str], ttl_s: float) -> int:
        """Hold these handed-over requests' KV at least ``ttl_s`` more: their decode calls are still
        open (the gateway's), so a decode that stalls past the lease still reads its own KV, never
        blocks freed and given to another request. Returns how many were still leased."""
        return sum(self.pool.extend(rid, ttl_s) for rid in request_ids)

    # ---- the loop ----
    def _loop(self) -> None:
        lower_thread_priority(self.nice)
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
            if chunks[0].seq.streams and not self.producer.is_ready(chunks[0].seq.request_id):
                raise self._push_error(chunks[0].seq)  # the decode went away after registering
            t0 = time.monotonic()
            logits = self.runner.run(chunks)
            self._synchronize()
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
            self._finishing.update((s.request_id, s) for s in done)
        for i, seq in enumerate(done):
            try:
                self._finish(seq, logits[i])
            finally:
                with self._wake:
                    self._finishing.pop(seq.request_id, None)
        self.refresh_metrics()

    def _finish(self, seq: Sequence, logits: torch.Tensor) -> None:
        req = seq.request
        if seq.abort_requested and not seq.streams:  # aborted during its last step: nothing to hand over
            blocks, seq.block_ids = seq.block_ids, []
            self._fail(seq, RequestCancelled(f"request {req.request_id} was aborted"), blocks)
            return
        try:
            token = sample_first_token(logits, req.sampling, req.prompt_token_ids)
            logprobs = None if req.num_logprobs is None else first_token_logprobs(logits, token, req.num_logprobs)
            seq.first_token, seq.first_logprobs = token, logprobs  # (an SGLang decode reads them from us)
            params = self._hand_over[seq.route](self, seq)
        except Exception as e:
            log.exception("publishing KV failed for %s", req.request_id)
            self._fail(seq, e)
            return
        if seq.abort_requested and not seq.streams:  # aborted while it was handed over: end that lease
            self.producer.abort(req.request_id)  # (its blocks are the lease's now: none left to free here)
            self._fail(seq, RequestCancelled(f"request {req.request_id} was aborted"), [])
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
        result = PrefillResult(req.request_id, token, seq.num_tokens, seq.num_cached, params, timings, logprobs)
        if not seq.future.set_running_or_notify_cancel():
            self.producer.abort(req.request_id)  # the caller went away: free at once
            return
        seq.future.set_result(result)

    # ---- the KV handed over, one handler per route (a raising handler leased nothing) ----
    def _finish_stream(self, seq: Sequence) -> dict:
        """Every layer's WRITE done (an abort meanwhile stops the wait at once); the staging blocks
        are free then: the KV is in the decode's blocks."""
        self.producer.finish(seq.request_id, stop=lambda: seq.abort_requested, first_token=seq.first_token,
                             logprobs=seq.first_logprobs, cached_tokens=seq.num_cached)
        blocks, seq.block_ids = seq.block_ids, []
        self.pool.free(blocks)
        return seq.params

    def _finish_stream_then_pull(self, seq: Sequence) -> dict:
        """The decode that registered READs the leased blocks; its params went out at submit."""
        self.producer.publish(seq.request_id, seq.block_ids, seq.num_tokens)
        seq.block_ids = []
        return seq.params

    def _finish_lease_for_later(self, seq: Sequence) -> dict:
        params = self.producer.hold(seq.request_id, seq.block_ids, seq.num_tokens)
        seq.block_ids = []
        return params

    def _finish_lease(self, seq: Sequence) -> dict:
        cached = {"cached_tokens": seq.num_cached} if seq.num_cached else {}  # (the decode reports it)
        params = self.producer.publish(seq.request_id, seq.block_ids, seq.num_tokens,
                                       decode_url=seq.request.decode_url, **cached)
        seq.block_ids = []
        return params

    _hand_over = {Route.STREAM: _finish_stream, Route.STREAM_THEN_PULL: _finish_stream_then_pull,
                  Route.LEASE_FOR_LATER: _finish_lease_for_later, Route.LEASE: _finish_lease}

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
        if seq.route.registers:  # no WRITE may still read the staging blocks when freed; the decode is told
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
        pulled = [s for s in self.scheduler.running if s.route is Route.STREAM_THEN_PULL]  # (its decode may cancel)
        for seq in list(self.scheduler.waiting) + pulled:
            if seq.route.registers and (why := self.producer.overdue(seq.request_id)):
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

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (blocks in use stay with their holders); returns how many
        blocks were freed at once."""
        freed = self.pool.reset_cache()
        log.info("prefix cache reset: %d blocks freed", freed)
        self.refresh_metrics()
        return freed

    def _count_lookup(self, queried: int, hit: int) -> None:
        self.metrics.prefix_cache_queries.inc(queried)
        self.metrics.prefix_cache_hits.inc(hit)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.blocks_in_use.set(self.pool.num_used)
        m.queue_depth.set(self.scheduler.num_waiting)
        m.running.set(len(self.scheduler.running))
        expired = self.pool.expired_total
        if expired > self._expired_seen:
            m.lease_expired.inc(expired - self._expired_seen)
            self._expired_seen = expired
        if (cache := self.pool.cache) is not None:
            m.prefix_cache_blocks.set(cache.num_cached)
            if cache.evictions > self._evictions_seen:
                m.prefix_cache_evictions.inc(cache.evictions - self._evictions_seen)
                self._evictions_seen = cache.evictions
        if (host := self.pool.host) is not None:
            m.prefix_cache_host_blocks.set(host.num_blocks)
            if host.restored > self._restored_seen:
                m.prefix_cache_host_restored.inc(host.restored - self._restored_seen)
                self._restored_seen = host.restored

    def refresh_metrics(self) -> None:
        """Bring gauges up to date (called after each step and on every /metrics scrape)."""
        self._update_gauges()

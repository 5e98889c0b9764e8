"""Token-budget scheduler with chunked prefill.

Each step takes up to ``token_budget`` prompt tokens from up to ``max_num_seqs`` sequences: first the
continuing chunks of sequences already running (oldest first), then new sequences admitted FIFO when
the pool can hold their whole prompt. A prompt longer than the budget is split into chunks over
several steps; later chunks attend to the earlier chunks' K/V through the pool.

STREAM sequences (connector mode) stream their KV out layer by layer, so they run as ONE whole-prompt
chunk in a step of their own, on a few staging blocks (``KVPool.stream_blocks_needed``), once their
decode has registered (``push_ready``); until then they wait without blocking the queue. If the
decode asked for the pull fallback (``wants_pull``), the sequence turns STREAM_THEN_PULL and runs
like any other from then on (whole prompt resident, chunked); its blocks are leased to the decode at
the end.

Prefix cache (``KVPool.cache``): a sequence admitted takes, before any new block, the cached blocks
of its prompt's longest cached head (one reference each) and starts computing after them, as a
later chunk would; at least the last prompt token is always computed (the first token is sampled
from its logits), so a fully cached prompt recomputes its last block into a new one. Each full
block is named in the cache once computed (``advance``). A STREAM sequence takes its cached head
the same way and computes only the rest: each layer's WRITE then sends the cached blocks' pages of
that layer as they are, and the rest's. The rest goes into whole blocks of its own when the pool
has them free (``stream_whole``: named like any prompt's, so later prompts hit them), else into
staging, whose blocks hold layers, not prompt positions, and are never named.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from kv_transfer.base import Route, StreamProducer
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.prefix_cache import block_hashes, with_client_salt
from prefill_server.engine.types import PrefillRequest
from prefill_server.errors import PoolExhausted, PromptTooLong


@dataclass(eq=False)
class Sequence:
    request: PrefillRequest
    future: Future
    t_submit: float = field(default_factory=time.monotonic)
    t_first_scheduled: float | None = None
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    params: dict | None = None  # STREAM: the kv_transfer_params handed to the decode at submit
    abort_requested: bool = False  # Engine.abort while running: its forward stops at the next layer (a batched
    # one once every prompt in it is aborted)
    # STREAM with the prefix cache on and room in the pool: its layers go into its own whole blocks
    # (named in the cache as computed), not into staging
    stream_whole: bool = False
    num_cached: int = 0  # prompt tokens found in the prefix cache (not computed)
    first_token: int | None = None  # sampled from the last position's logits, once computed
    first_logprobs: tuple[tuple[int, float], ...] | None = None  # (token, logprob): the sampled one, then the top k
    # the prompt's full blocks' hashes (prefix cache on; None: not computed yet) and how many of its
    # blocks are named in the cache or were found there
    block_hashes: list[bytes] | None = None
    num_named: int = 0
    route: Route = field(init=False)  # the request's; STREAM turns STREAM_THEN_PULL if its decode asks

    def __post_init__(self) -> None:
        self.route = self.request.route

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_kv_tokens(self) -> int:
        """Token positions its pool blocks cover: the prompt and the room asked for past it."""
        return self.num_tokens + self.request.room_tokens

    @property
    def streams(self) -> bool:
        """Each layer is written to the decode as it is computed (one whole-prompt step)."""
        return self.route is Route.STREAM


@dataclass(frozen=True)
class Chunk:
    seq: Sequence
    start: int  # first prompt position computed in this step
    end: int  # one past the last

    @property
    def is_last(self) -> bool:
        return self.end == self.seq.num_tokens


class Scheduler:
    STREAM_SLOTS = 2  # layers of a streamed prompt held at once (one computing, one in flight)

    def __init__(self, pool: KVPool, token_budget: int, max_num_seqs: int, max_queue_wait_s: float,
                 stream: StreamProducer | None = None):
        """stream: the producer STREAM sequences wait on (has their decode registered? did it ask
        for the pull fallback?). ``on_lookup(prompt tokens, cached tokens)`` is called for each
        sequence admitted with the prefix cache on (metrics)."""
        assert token_budget > 0 and max_num_seqs > 0
        self.pool = pool
        self.push_ready = stream.is_ready if stream else (lambda rid: True)
        self.wants_pull = stream.wants_pull if stream else (lambda rid: False)
        self.token_budget, self.max_num_seqs = token_budget, max_num_seqs
        self.max_queue_wait_s = max_queue_wait_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # the last schedule() stopped admitting because the pool could not hold the next prompt
        # (else the queue waits for compute: the token budget or max_num_seqs)
        self.blocked_on_kv = False
        self.on_lookup = lambda queried, hit: None
        # pending_tokens() as of the last change, readable without the engine's lock: the 429 path
        # must never wait for the compute thread (it runs at a lower priority and may be preempted
        # holding the lock); one int is read atomically
        self.queued_tokens = 0

    def blocks_for(self, seq_or_n, push: bool = False) -> int:
        if isinstance(seq_or_n, Sequence):
            seq_or_n, push = seq_or_n.num_kv_tokens, seq_or_n.streams
        if push:
            return self.pool.stream_blocks_needed(seq_or_n, self.STREAM_SLOTS)
        return self.pool.blocks_needed(seq_or_n)

    def check_fits(self, num_tokens: int, push: bool = False, room: int = 0) -> None:
        """Reject at once a prompt the pool could never hold. ``num_tokens`` counts ``room`` tokens
        of KV the engine leases past the prompt (the first token's, for the decode to write)."""
        if push and self.blocks_for(num_tokens, True) > self.pool.num_blocks:
            raise PromptTooLong(
                f"streaming a prompt of {num_tokens} tokens needs {self.blocks_for(num_tokens, True)} "
                f"staging blocks; the pool has {self.pool.num_blocks}: send a shorter prompt")
        if not push and self.pool.blocks_needed(num_tokens) > self.pool.num_blocks:
            what = f"{num_tokens - room} tokens (and room for {room} more)" if room else f"{num_tokens} tokens"
            raise PromptTooLong(
                f"a prompt of {what} needs {self.pool.blocks_needed(num_tokens)} KV blocks; "
                f"the pool has {self.pool.num_blocks} blocks of {self.pool.block_size} tokens "
                f"({self.pool.num_blocks * self.pool.block_size} tokens): send a shorter prompt")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_kv_tokens, seq.streams)
        self.waiting.append(seq)
        self._publish()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pending_tokens(self) -> int:
        """Prompt tokens still to compute: the rest of the running prompts and all waiting ones."""
        return (sum(s.num_tokens - s.num_computed for s in self.running)
                + sum(s.num_tokens for s in self.waiting))

    def _publish(self) -> None:  # after every change to waiting, running or num_computed
        self.queued_tokens = self.pending_tokens()

    def schedule(self) -> tuple[list[Chunk], list[Sequence]]:
        """Returns (chunks to compute this step, sequences that waited longer than max_queue_wait_s
        to start; ``blocked_on_kv`` says whether the pool or compute held the queue up)."""
        chunks: list[Chunk] = []
        self.blocked_on_kv = False
        budget = self.token_budget
        for seq in self.running:
            if budget <= 0:
                break
            n = min(budget, seq.num_tokens - seq.num_computed)
            chunks.append(Chunk(seq, seq.num_computed, seq.num_computed + n))
            budget -= n
        timed_out: list[Sequence] = []
        now = time.monotonic()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.streams:
                if not self.push_ready(seq.request_id):
                    continue  # its decode has not registered yet: let others go first
                if self.wants_pull(seq.request_id):
                    seq.route = Route.STREAM_THEN_PULL  # from here on an ordinary sequence
                elif chunks:
                    break  # a streamed prompt runs in a step of its own
            cached = self._cached_head(seq)  # (held first: allocate never evicts them)
            try:
                seq.block_ids = cached + self.pool.allocate(self._new_blocks(seq, len(cached)))
            except PoolExhausted:
                self.pool.free(cached)
                self.blocked_on_kv = True
                break  # FIFO: wait for leases to end rather than starve long prompts
            if seq.block_hashes is not None:
                seq.num_named = len(cached)
                seq.num_computed = seq.num_cached = len(cached) * self.pool.block_size
                self.on_lookup(seq.num_tokens, seq.num_cached)
            self.waiting.remove(seq)
            seq.t_first_scheduled = now
            self.running.append(seq)
            if seq.streams:
                self._publish()
                return [Chunk(seq, seq.num_computed, seq.num_tokens)], timed_out
            n = min(budget, seq.num_tokens - seq.num_computed)
            chunks.append(Chunk(seq, seq.num_computed, seq.num_computed + n))
            budget -= n
        for seq in list(self.waiting):  # (a push sequence waiting for its decode: see Engine)
            if now - seq.t_submit > self.max_queue_wait_s and (not seq.streams or self.push_ready(seq.request_id)):
                self.waiting.remove(seq)
                timed_out.append(seq)
        self._publish()
        return chunks, timed_out

    def _new_blocks(self, seq: Sequence, num_cached_blocks: int) -> int:
        """Blocks to allocate for ``seq`` past its cached head: the rest of the prompt, or for
        STREAM the staging of the rest (the cached head's pages are sent as they are)."""
        if seq.streams:
            whole = self.pool.blocks_needed(seq.num_kv_tokens) - num_cached_blocks
            seq.stream_whole = self.pool.cache is not None and whole <= self.pool.num_free
            if seq.stream_whole:
                return whole
            rest = seq.num_kv_tokens - num_cached_blocks * self.pool.block_size
            return self.pool.stream_blocks_needed(rest, self.STREAM_SLOTS)
        return self.blocks_for(seq) - num_cached_blocks

    def _cached_head(self, seq: Sequence) -> list[int]:
        """The cached blocks of the prompt's head, referenced for ``seq`` ([] with the cache off);
        never the block of the last prompt token."""
        if self.pool.cache is None:
            return []
        if seq.block_hashes is None:  # (the engine hashes at submit, outside its lock)
            seq.block_hashes = prompt_hashes(self.pool, seq.request)
        return self.pool.acquire_prefix(seq.block_hashes[:(seq.num_tokens - 1) // self.pool.block_size])

    def advance(self, chunks: list[Chunk]) -> list[Sequence]:
        """Record computed chunks (their full blocks named in the prefix cache); returns sequences
        whose whole prompt is now computed."""
        done = []
        for c in chunks:
            c.seq.num_computed = c.end
            self._name_blocks(c.seq)
            if c.is_last:
                self.running.remove(c.seq)
                done.append(c.seq)
        self._publish()
        return done

    def _name_blocks(self, seq: Sequence) -> None:
        """Name the sequence's newly computed full blocks in the prefix cache."""
        if seq.block_hashes is None or (seq.streams and not seq.stream_whole):  # (staging holds layers)
            return
        full = min(seq.num_computed // self.pool.block_size, len(seq.block_hashes))
        if full > seq.num_named:
            self.pool.cache_blocks(seq.block_ids[seq.num_named:full], seq.block_hashes[seq.num_named:full])
            seq.num_named = full

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (failed or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._publish()
        if seq.block_ids:
            self.pool.free(seq.block_ids)
            seq.block_ids = []

    def find(self, request_id: str) -> Sequence | None:
        for seq in list(self.running) + list(self.waiting):
            if seq.request_id == request_id:
                return seq
        return None


def prompt_hashes(pool: KVPool, req: PrefillRequest) -> list[bytes]:
    """Hashes of a request's full prompt blocks in ``pool``'s prefix cache (on)."""
    return block_hashes(req.prompt_token_ids, pool.block_size, with_client_salt(pool.cache_salt, req.cache_salt))

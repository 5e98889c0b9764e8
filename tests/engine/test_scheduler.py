from concurrent.futures import Future

import pytest
import torch

from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.scheduler import Scheduler, Sequence
from prefill_server.engine.types import PrefillRequest
from prefill_server.errors import PromptTooLong


def seq(rid, n):
    return Sequence(PrefillRequest(rid, tuple(range(n))), Future())


def make(num_blocks=16, budget=10, max_seqs=4, wait=60.0):
    pool = KVPool(1, num_blocks, 1, 4, 2, torch.float32)
    return pool, Scheduler(pool, budget, max_seqs, wait)


def test_chunks_respect_budget_and_order():
    pool, s = make()
    a, b = seq("a", 23), seq("b", 5)
    s.add(a), s.add(b)
    chunks, _ = s.schedule()
    assert [(c.seq.request_id, c.start, c.end) for c in chunks] == [("a", 0, 10)]
    assert s.advance(chunks) == []
    chunks, _ = s.schedule()
    assert [(c.seq.request_id, c.start, c.end) for c in chunks] == [("a", 10, 20)]
    s.advance(chunks)
    chunks, _ = s.schedule()  # a's last 3 tokens share the step with b's first 5
    assert [(c.seq.request_id, c.start, c.end) for c in chunks] == [("a", 20, 23), ("b", 0, 5)]
    assert s.advance(chunks) == [a, b]
    assert not s.has_work()
    assert pool.num_used == 6 + 2  # blocks stay with the sequences until published


def test_waits_for_blocks_then_times_out():
    pool, s = make(num_blocks=4, wait=0.0)
    held = pool.allocate(3)
    s.add(seq("x", 8))  # needs 2 blocks, 1 free
    chunks, timed_out = s.schedule()
    assert chunks == [] and [q.request_id for q in timed_out] == ["x"]
    pool.free(held)


def test_never_fitting_prompt_is_refused_at_once():
    _, s = make(num_blocks=2)
    with pytest.raises(PromptTooLong, match="send a shorter prompt"):
        s.add(seq("big", 9))


def test_remove_frees_blocks():
    pool, s = make()
    a = seq("a", 12)
    s.add(a)
    s.schedule()
    assert pool.num_used == 3
    s.remove(a)
    assert pool.num_used == 0 and not s.has_work()


def test_the_queued_tokens_others_read_follow_every_change():
    """``queued_tokens`` (what admission reads without the engine's lock) equals pending_tokens()
    after each add, schedule, advance and remove."""
    pool, s = make()
    a, b, c = seq("a", 23), seq("b", 5), seq("c", 7)

    def same():
        assert s.queued_tokens == s.pending_tokens()
        return s.queued_tokens
    assert same() == 0
    s.add(a), s.add(b), s.add(c)
    assert same() == 35
    chunks, _ = s.schedule()
    s.advance(chunks)
    assert same() == 25
    s.remove(c)
    assert same() == 18
    while s.has_work():
        s.advance(s.schedule()[0])
        same()
    assert same() == 0

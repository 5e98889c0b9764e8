"""Graph steps (prefill_server/engine/graphs.py) off CUDA: the graph's forward over its padded static
buffers, run eagerly (StepGraphs(capture=False)), against the eager step; which steps take a graph;
capture-on-second-sight, the LRU bound and the fall-back to eager when a capture fails. The CUDA
capture itself is checked on the GPU (docs/bench/2026-12-03-prefix-cache-graphs/)."""
from concurrent.futures import Future

import pytest
import torch

from kv_transfer.base import Route
from prefill_server.bench.common import model_config, random_model
from prefill_server.engine import graphs as graphs_mod
from prefill_server.engine.graphs import NOT_RUN, StepGraphs, bucket
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.runner import ModelRunner
from prefill_server.engine.scheduler import Chunk, Sequence
from prefill_server.engine.types import PrefillRequest

BS = 16


@pytest.fixture(scope="module")
def model():
    return random_model(model_config("tiny"), torch.device("cpu"), torch.float32, seed=0)


def make_runner(model, num_blocks=64, sparse=None):
    cfg = model.config
    pool = KVPool(cfg.num_layers, num_blocks, cfg.num_kv_heads, BS, cfg.head_dim, torch.float32, "cpu")
    return ModelRunner(model, pool, cfg.head_dim, torch.device("cpu"), sparse=sparse)


def make_seq(runner, n, seed=0, rid="s"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.model.config.vocab_size, (n,), generator=g).tolist()
    seq = Sequence(PrefillRequest(rid, tuple(ids)), Future())
    seq.block_ids = runner.pool.allocate(runner.pool.blocks_needed(n))
    return seq


def tail_kv(pool, seq, start, end):
    return [tuple(t[start:end].clone() for t in pool.read(layer, seq.block_ids, end)) for layer in range(pool.num_layers)]


def test_bucket():
    assert [bucket(t) for t in (1, 16, 17, 32, 33, 64, 65, 128, 200, 256, 257, 512)] == \
        [16, 16, 32, 32, 64, 64, 128, 128, 256, 256, 320, 512]


def test_no_graphs_off_cuda(model):
    assert make_runner(model).graphs is None
    assert not StepGraphs.wanted(torch.device("cpu"), torch.bfloat16)
    assert not StepGraphs.wanted(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("start,t", [(64, 16), (64, 13), (80, 40), (48, 64), (32, 65), (128, 1)])
def test_graph_forward_equals_eager_step(model, start, t):
    """Padded to bucket(t) rows over start + bucket(t) keys: the real rows' logits and K/V are the
    eager step's; the padding writes nothing outside the chunk's own slots."""
    runner = make_runner(model)
    end = start + t
    seq = make_seq(runner, end)
    other = make_seq(runner, 64, seed=1, rid="other")  # blocks next to the sequence's
    runner.run([Chunk(seq, 0, start)])
    runner.run([Chunk(other, 0, 64)])
    before = runner.pool.kv.clone()
    ref = runner.run([Chunk(seq, start, end)])
    ref_kv = tail_kv(runner.pool, seq, start, end)
    runner.pool.kv.copy_(before)  # the chunk's slots as before the eager step
    sg = StepGraphs(runner, capture=False)
    sg.CAPTURE_AFTER = 1
    got = sg.run([Chunk(seq, start, end)])
    assert got is not NOT_RUN and sg.stats["captures"] == 1 and list(sg.graphs) == [(start, bucket(t))]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for (k, v), (rk, rv) in zip(tail_kv(runner.pool, seq, start, end), ref_kv):
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)
    # nothing else in the pool changed: the head, the other sequence, free blocks
    changed = (runner.pool.kv != before).any(-1).any(-2)  # [L, NB, N]
    for layer in range(runner.pool.num_layers):
        slots = {(b, o) for b, o in changed[layer].nonzero().tolist()}
        own = {(seq.block_ids[p // BS], p % BS) for p in range(start, end)}
        assert slots <= own, sorted(slots - own)


def test_replay_with_other_inputs_in_the_same_graph(model):
    """One graph (start 64, 32 rows) serves chunks of 17..32 tokens of different sequences."""
    runner = make_runner(model)
    sg = StepGraphs(runner, capture=False)
    sg.CAPTURE_AFTER = 1
    for i, t in enumerate((32, 20, 17, 31)):
        seq = make_seq(runner, 64 + t, seed=10 + i, rid=f"s{i}")
        runner.run([Chunk(seq, 0, 64)])
        ref = runner.run([Chunk(seq, 64, 64 + t)])
        got = sg.run([Chunk(seq, 64, 64 + t)])
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        runner.pool.free(seq.block_ids)
    assert list(sg.graphs) == [(64, 32)] and sg.stats["captures"] == 1 and sg.stats["replays"] == 3


def test_which_steps_take_a_graph(model):
    runner = make_runner(model)
    sg = StepGraphs(runner, capture=False)
    seq = make_seq(runner, 200)
    two = make_seq(runner, 100, seed=2, rid="two")
    assert sg.key([Chunk(seq, 64, 200)]) == (64, 192)
    assert sg.key([Chunk(seq, 0, 200)]) is None  # first chunk, no cache
    assert sg.key([Chunk(seq, 64, 200), Chunk(two, 16, 100)]) is None  # several chunks
    assert sg.key([Chunk(seq, 64, 64)]) is None  # nothing to compute
    long_seq = make_seq(runner, 16 + 513, seed=3, rid="long")
    assert sg.key([Chunk(long_seq, 16, 16 + 513)]) is None  # past MAX_T
    seq.route = Route.STREAM  # a streamed step
    assert sg.key([Chunk(seq, 64, 200)]) is None
    seq.route = Route.LEASE
    short = Sequence(PrefillRequest("short", tuple(range(100))), Future())
    short.block_ids = seq.block_ids[:2]  # too few blocks for its tokens
    assert sg.key([Chunk(short, 16, 100)]) is None
    sg.MAX_KEYS = 200
    assert sg.key([Chunk(seq, 64, 200)]) is None  # past MAX_KEYS
    sparse_runner = make_runner(model, sparse=object())
    assert StepGraphs(sparse_runner, capture=False).key([Chunk(seq, 64, 200)]) is None


def test_capture_on_second_sight_and_lru(model):
    runner = make_runner(model, num_blocks=128)
    sg = StepGraphs(runner, capture=False)
    sg.MAX_GRAPHS = 2
    seqs = [make_seq(runner, 64 + 16 * (i + 1), seed=20 + i, rid=f"l{i}") for i in range(3)]
    for s in seqs:
        runner.run([Chunk(s, 0, 64)])

    def step(i):
        s = seqs[i]
        return sg.run([Chunk(s, 64, s.num_tokens)])

    assert step(0) is NOT_RUN and sg.stats["eager_first"] == 1  # first sight: eager
    assert step(0) is not NOT_RUN and sg.stats["captures"] == 1  # second: captured
    assert step(0) is not NOT_RUN and sg.stats["replays"] == 1
    for i in (1, 2):
        assert step(i) is NOT_RUN and step(i) is not NOT_RUN
    assert list(sg.graphs) == [(64, 32), (64, 64)] and sg.stats["evictions"] == 1  # (64, 16) dropped


def test_failed_capture_falls_back_to_eager(model, monkeypatch):
    runner = make_runner(model)
    seq = make_seq(runner, 100)
    runner.run([Chunk(seq, 0, 64)])
    ref = runner.run([Chunk(seq, 64, 100)])
    sg = StepGraphs(runner, capture=False)
    sg.CAPTURE_AFTER = 1
    runner.graphs = sg

    def broken(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_mod._StepGraph, "forward", broken)
    got = runner.run([Chunk(seq, 64, 100)])  # the capture fails: the eager step
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert sg.stats["capture_failures"] == 1 and (64, 64) in sg.failed and not sg.graphs
    assert sg.run([Chunk(seq, 64, 100)]) is NOT_RUN  # the key is not tried again
    for start in (16, 32):  # two more failures: graphs off for this runner
        sg.run([Chunk(seq, start, 100)])
    assert sg.disabled and sg.key([Chunk(seq, 48, 100)]) is None


def test_graph_step_in_the_engine_path(model):
    """ModelRunner.run with graphs on (eagerly run): a not-last chunk returns None, a last one the
    eager step's logits."""
    runner = make_runner(model)
    ref_runner = make_runner(model)
    sg = StepGraphs(runner, capture=False)
    sg.CAPTURE_AFTER = 1
    runner.graphs = sg
    seq = make_seq(runner, 120)
    ref_seq = make_seq(ref_runner, 120)
    for r, s in ((runner, seq), (ref_runner, ref_seq)):
        r.run([Chunk(s, 0, 48)])
        assert r.run([Chunk(s, 48, 100)]) is None  # not the last chunk
    assert sg.stats["captures"] == 1
    got = runner.run([Chunk(seq, 100, 120)])
    ref = ref_runner.run([Chunk(ref_seq, 100, 120)])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_pool_read_through_a_table_and_both_gathers():
    pool = KVPool(2, 8, 2, 4, 3, torch.float32)
    blocks = pool.allocate(3)
    k, v = torch.randn(10, 2, 3), torch.randn(10, 2, 3)
    b, o = pool.slot_mapping(blocks, 0, 10)
    pool.write(1, b, o, k, v)
    table = pool.block_table(blocks, 10)
    for one_copy in (True, False):
        pool.read_one_copy = one_copy
        for n in (10, 7):
            rk, rv = pool.read(1, None, n, table=table)
            assert torch.equal(rk, k[:n]) and torch.equal(rv, v[:n])
    with pytest.raises(ValueError, match="fewer than"):
        pool.block_table(blocks, 13)


def test_graphs_dropped_when_weights_or_pool_move(model):
    runner = make_runner(model)
    sg = StepGraphs(runner, capture=False)
    sg.CAPTURE_AFTER = 1
    seq = make_seq(runner, 100)
    runner.run([Chunk(seq, 0, 64)])
    sg.run([Chunk(seq, 64, 100)])
    assert len(sg.graphs) == 1
    sg.run([Chunk(seq, 64, 100)])
    assert sg.stats["replays"] == 1
    runner.pool.kv = runner.pool.kv.clone()  # the pool moved: the graph would read freed memory
    sg.run([Chunk(seq, 64, 100)])
    assert sg.stats["replays"] == 1 and sg.stats["captures"] == 2  # dropped, captured again

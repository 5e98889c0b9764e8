"""The engine on the real embedded model: chunked and batched prefill equal one plain forward."""
import os
import time

import pytest
import torch

from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.engine.engine import Engine
from prefill_server.engine.local_producer import LocalProducer
from prefill_server.engine.types import PrefillRequest
from prefill_server.errors import InvalidRequest, PoolExhausted, RequestCancelled
from prefill_server.models.reference_attention import CausalAttention


@pytest.fixture(scope="module")
def loaded():
    return build.load(EngineConfig(dtype="float32"))


def make_engine(loaded, num_blocks=64, budget=40, max_wait=60.0, ttl=30.0):
    cfg = EngineConfig(dtype="float32", num_kv_blocks=num_blocks, block_size=16, token_budget=budget)
    pool = build.make_pool(cfg, loaded)
    eng = Engine(build.make_runner(loaded, pool), pool, LocalProducer(pool, ttl),
                 max_model_len=loaded.config.max_position_embeddings, vocab_size=loaded.config.vocab_size,
                 token_budget=budget, max_num_seqs=8, max_queue_wait_s=max_wait)
    eng.start()
    return eng


def reference(loaded, ids):
    attn = CausalAttention.single(len(ids), record=True)
    logits = loaded.model(torch.tensor(ids), torch.arange(len(ids)), attn, torch.tensor([len(ids) - 1]))
    return logits[0], attn


def prompt(loaded, text):
    return loaded.tokenizer.encode(text)


def test_chunked_batched_prefill_matches_plain_forward(loaded):
    eng = make_engine(loaded, budget=40)  # 40-token steps: prompts are chunked and share steps
    try:
        texts = ["The quick brown fox jumps over the lazy dog. " * 6, "Hello!", "Numbers: " + " ".join(
            str(i) for i in range(30))]
        reqs = [PrefillRequest(f"r{i}", tuple(prompt(loaded, t))) for i, t in enumerate(texts)]
        futs = [eng.submit(r) for r in reqs]
        results = [f.result(timeout=120) for f in futs]
        pool = eng.pool
        for r, res in zip(reqs, results):
            ref_logits, attn = reference(loaded, list(r.prompt_token_ids))
            assert res.first_token_id == int(torch.argmax(ref_logits))
            blocks = pool.get_lease(r.request_id).block_ids
            for layer in (0, loaded.config.num_layers - 1):
                k, v = pool.read(layer, blocks, len(r.prompt_token_ids))
                torch.testing.assert_close(k, attn.keys[layer], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(v, attn.values[layer], rtol=1e-4, atol=1e-4)
            assert res.kv_transfer_params["num_tokens"] == len(r.prompt_token_ids)
            assert eng.abort(r.request_id)
        assert pool.num_used == 0
    finally:
        eng.stop()


def test_validation_and_abort_free_everything(loaded):
    eng = make_engine(loaded, num_blocks=8, budget=16, max_wait=0.5)
    try:
        with pytest.raises(InvalidRequest, match="empty"):
            eng.submit(PrefillRequest("e", ()))
        with pytest.raises(InvalidRequest, match="vocabulary"):
            eng.submit(PrefillRequest("v", (1, -3)))
        with pytest.raises(InvalidRequest, match="shorter prompt"):
            eng.submit(PrefillRequest("big", tuple([1] * (8 * 16 + 1))))
        # fill the pool with a leased request, then a second one must time out waiting
        held = eng.submit(PrefillRequest("held", tuple([1] * 100))).result(timeout=60)
        with pytest.raises(PoolExhausted):
            eng.submit(PrefillRequest("starved", tuple([2] * 100))).result(timeout=60)
        with pytest.raises(InvalidRequest, match="already in use"):
            eng.submit(PrefillRequest("held", (1, 2)))
        assert eng.abort(held.request_id) and eng.pool.num_used == 0
        # abort while queued/running
        f = eng.submit(PrefillRequest("gone", tuple([3] * 120)))
        assert eng.abort("gone")
        try:  # almost always still running (8 steps of 16 tokens); if it won the race, abort released it
            f.result(timeout=60)
        except RequestCancelled:
            pass
        time.sleep(0.1)
        assert eng.pool.num_used == 0
    finally:
        eng.stop()


def test_lease_expiry_frees_blocks(loaded):
    eng = make_engine(loaded, ttl=0.3)
    try:
        eng.submit(PrefillRequest("x", tuple(prompt(loaded, "expire me")))).result(timeout=60)
        assert eng.pool.num_used > 0
        deadline = time.monotonic() + 5
        while eng.pool.num_used and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.pool.num_used == 0
        eng.refresh_metrics()
        assert eng.metrics.lease_expired._value.get() == 1
    finally:
        eng.stop()


def test_room_tokens_lease_blocks_past_the_prompt(loaded):
    """room_tokens=1: a 32-token prompt (2 blocks of 16) leases 3, for a decode sent prompt + [t1];
    the room counts against the pool at submit too."""
    eng = make_engine(loaded, num_blocks=4)
    try:
        r = eng.submit(PrefillRequest("r", tuple([5] * 32), room_tokens=1)).result(timeout=60)
        assert eng.pool.num_used == 3 and r.num_prompt_tokens == 32
        assert eng.abort("r") and eng.pool.num_used == 0
        eng.submit(PrefillRequest("fits", tuple([5] * 63), room_tokens=1)).result(timeout=60)
        eng.abort("fits")
        with pytest.raises(InvalidRequest, match="shorter prompt"):
            eng.submit(PrefillRequest("over", tuple([5] * 64), room_tokens=1))
    finally:
        eng.stop()


def test_warm_up_measures_throughput_and_returns_its_blocks(loaded):
    cfg = EngineConfig(dtype="float32", num_kv_blocks=16, block_size=16, token_budget=64)
    pool = build.make_pool(cfg, loaded)
    eng = Engine(build.make_runner(loaded, pool), pool, LocalProducer(pool, 30), max_model_len=8192,
                 vocab_size=loaded.config.vocab_size, token_budget=64, max_num_seqs=8, max_queue_wait_s=60)
    assert eng.throughput.tokens_per_s() is None
    assert eng.warm_up(512) > 0  # (capped at the token budget: 64 tokens)
    assert eng.throughput.tokens_per_s() > 0 and pool.num_used == 0
    assert eng.warm_up(0) is None


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice is a Linux feature")
def test_engine_thread_runs_below_the_server(loaded):
    """The step loop's thread gets the nice asked for; the process's other threads keep theirs."""
    cfg = EngineConfig(dtype="float32", num_kv_blocks=16, block_size=16, token_budget=64)
    pool = build.make_pool(cfg, loaded)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    eng = Engine(build.make_runner(loaded, pool), pool, LocalProducer(pool, 30), max_model_len=8192,
                 vocab_size=loaded.config.vocab_size, token_budget=64, max_num_seqs=8, max_queue_wait_s=60,
                 nice=10)
    eng.start()
    try:
        nice = None
        for _ in range(200):  # (the thread sets it as it starts)
            nice = os.getpriority(os.PRIO_PROCESS, eng._thread.native_id)
            if nice != before:
                break
            time.sleep(0.01)
        assert nice == min(19, before + 10)
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
        assert eng.submit(PrefillRequest("nice-1", (1, 2, 3))).result(timeout=60).num_prompt_tokens == 3
    finally:
        eng.stop()


def test_engine_nice_is_checked():
    with pytest.raises(ValueError, match="--engine-nice"):
        EngineConfig(engine_nice=20).validate()
    with pytest.raises(ValueError, match="--engine-nice"):
        EngineConfig(engine_nice=-1).validate()


def test_cpu_threads_are_halved_while_that_is_faster(monkeypatch):
    """A busy core stalls a team that counts on it: fewer threads may be faster (choose_cpu_threads)."""
    state = {"threads": 8}
    monkeypatch.setattr(torch, "get_num_threads", lambda: state["threads"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: state.update(threads=n))
    for seconds, expected in (({8: 4.0, 4: 2.0, 2: 3.0, 1: 1.0}, 4),  # stops at the first slower count
                              ({8: 1.0, 4: 2.0, 2: 3.0, 1: 4.0}, 8),
                              ({8: 4.0, 4: 3.0, 2: 2.0, 1: 1.0}, 1)):
        state["threads"] = 8
        assert build.choose_cpu_threads(lambda n: seconds[state["threads"]], 64) == expected
        assert state["threads"] == expected


def test_a_full_queue_is_refused_while_the_compute_thread_holds_the_lock(loaded):
    """check_admission (the gateway's 429 before it tokenizes) reads the published queue and rate:
    it answers at once even while the engine's lock is held by the (lower priority) step loop."""
    import threading

    from prefill_server.errors import Overloaded

    cfg = EngineConfig(dtype="float32", num_kv_blocks=64, block_size=16, token_budget=64)
    pool = build.make_pool(cfg, loaded)
    eng = Engine(build.make_runner(loaded, pool), pool, LocalProducer(pool, 30), max_model_len=8192,
                 vocab_size=loaded.config.vocab_size, token_budget=64, max_num_seqs=8, max_queue_wait_s=1.0)
    eng.throughput.record(100, 1.0)  # 100 tokens/s; not started: the queue stays
    eng.check_admission()
    for i in range(2):  # 200 tokens ahead = 2 s > the 1 s a request may wait
        eng.submit(PrefillRequest(f"q{i}", tuple(range(1, 101))))
    held, done = threading.Event(), threading.Event()

    def hold():
        with eng._wake:
            held.set()
            done.wait(10)
    t = threading.Thread(target=hold)
    t.start()
    try:
        held.wait(5)
        t0 = time.monotonic()
        with pytest.raises(Overloaded, match="--max-queue-wait"):
            eng.check_admission()
        assert time.monotonic() - t0 < 1.0
    finally:
        done.set()
        t.join()
    with pytest.raises(Overloaded):  # submit checks again under the lock
        eng.submit(PrefillRequest("q2", (1, 2, 3)))
    eng.stop()


@pytest.mark.parametrize("kw,needle", [({"device": "banana"}, "--device must be"),
                                       ({"device": "cuda:x"}, "--device must be"),
                                       ({"max_num_seqs": 0}, "--max-num-seqs must be"),
                                       ({"kv_cache_gib": 0.0}, "--kv-cache-gib must be"),
                                       ({"num_kv_blocks": -1}, "--num-kv-blocks must be")])
def test_engine_flags_are_checked_one_by_one(kw, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**kw).validate()
    EngineConfig(device="cuda:1").validate()  # (the form only: whether it is there is pick_device's)


def test_a_gpu_that_is_not_there_and_a_pool_larger_than_memory_are_refused_by_flag(monkeypatch):
    from prefill_server.engine import build

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: torch .* sees no CUDA GPU"):
        build.pick_device("cuda")
    assert build.pick_device("auto") == torch.device("cpu")
    free = build.host_memory_available()
    assert free > 0
    build.check_room(free // 2, torch.device("cpu"), "--kv-cache-gib")
    with pytest.raises(ValueError, match="--num-kv-blocks: the KV pool would need .* GiB free on cpu"):
        build.check_room(free * 2, torch.device("cpu"), "--num-kv-blocks")


def test_a_pool_shorter_than_the_context_is_named_at_start(loaded, caplog):
    """SmolLM2's 8,192-token context needs 512 blocks of 16: a pool of 64 says so when the engine is
    built (its longer prompts get 400), one of 512 says nothing."""
    with caplog.at_level("WARNING", logger="prefill_server.engine.engine"):
        eng = make_engine(loaded, num_blocks=64)
        eng.stop()
    assert any("needs 512" in r.message and "--kv-cache-gib" in r.message for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="prefill_server.engine.engine"):
        make_engine(loaded, num_blocks=512).stop()
    assert not [r for r in caplog.records if "KV pool" in r.message], caplog.text


def test_an_abort_during_the_last_step_leaves_no_lease(loaded):
    """Aborted (gRPC Release) while its last forward runs: the request fails RequestCancelled and its
    KV is freed, instead of a lease published after the abort said yes, that nobody reads."""
    eng = make_engine(loaded)
    run = eng.runner.run

    def slow_run(chunks):
        time.sleep(0.5)
        return run(chunks)

    eng.runner.run = slow_run
    try:
        f = eng.submit(PrefillRequest("last", tuple([5] * 30)))  # one step (budget 40)
        deadline = time.monotonic() + 10
        while not eng.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # inside the forward
        assert eng.abort("last")
        with pytest.raises(RequestCancelled):
            f.result(timeout=30)
        assert eng.pool.num_used == 0 and not eng.abort("last")
    finally:
        eng.stop()


def test_a_release_right_after_the_answer_frees_the_lease(loaded):
    """The caller has its result (and releases the KV) while the engine still counts the request as
    being handed over: the release frees the lease then and there."""
    eng = make_engine(loaded)
    finish = eng._finish

    def slow_finish(seq, logits):
        finish(seq, logits)
        time.sleep(0.5)  # the result is out; the hand-over's bookkeeping is not done yet

    eng._finish = slow_finish
    try:
        r = eng.submit(PrefillRequest("quick", tuple([5] * 30))).result(timeout=30)
        assert eng.pool.num_used > 0 and eng.abort(r.request_id)
        assert eng.pool.num_used == 0
    finally:
        eng.stop()


def test_an_abort_stops_the_running_forward_at_the_next_layer(loaded):
    """A long step is not finished for a request nobody waits for: aborted as layer 3 starts, the
    forward computes no attention from then on, the request fails RequestCancelled and its blocks
    are free."""
    from prefill_server.engine import runner as runner_mod

    eng = make_engine(loaded)
    seen: list[int] = []
    call = runner_mod.PagedAttention.__call__

    def spy(self, layer, *a, **kw):
        seen.append(layer)
        if layer == 3:
            eng.abort("long")  # (from the compute thread: the engine lock is not held during a forward)
        return call(self, layer, *a, **kw)

    runner_mod.PagedAttention.__call__ = spy
    try:
        f = eng.submit(PrefillRequest("long", tuple([5] * 30)))  # one step
        with pytest.raises(RequestCancelled):
            f.result(timeout=30)
        assert seen == [0, 1, 2, 3] and eng.pool.num_used == 0
    finally:
        runner_mod.PagedAttention.__call__ = call
        eng.stop()

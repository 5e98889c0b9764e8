"""Stress: thousands of requests through the engine (its real scheduler, pool, lease expiry and
abort paths; a stand-in forward that writes a marker per token) on a pool far smaller than the
working set. Every result's leased K/V must be its own prompt's markers (a block in use evicted or
reused would show another prompt's), and at the end no block is referenced (none leaked, none freed
twice: the pool asserts that itself), with a plausible hit rate."""
import random
import time
from concurrent.futures import wait

import torch

from prefill_server.engine.engine import Engine
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.local_producer import LocalProducer
from prefill_server.engine.prefix_cache import salt_of
from prefill_server.engine.types import PrefillRequest
from prefill_server.errors import RequestCancelled

VOCAB, BS = 500, 4


class MarkingRunner:
    """K = V = token id * 1000 + position for every computed token; logits of zeros."""

    stream_to = None

    def __init__(self, pool: KVPool):
        self.pool = pool

    def run(self, chunks):
        for c in chunks:
            ids = torch.tensor(c.seq.request.prompt_token_ids[c.start:c.end], dtype=torch.float32)
            mark = (ids * 1000 + torch.arange(c.start, c.end))[:, None, None]  # [T, 1, 1]
            blocks, offsets = self.pool.slot_mapping(c.seq.block_ids, c.start, c.end)
            self.pool.write(0, blocks, offsets, mark, mark)
        n = sum(c.is_last for c in chunks)
        return torch.zeros(n, VOCAB) if n else None


def expected(ids):
    return torch.tensor(ids, dtype=torch.float32) * 1000 + torch.arange(len(ids))


def test_thousands_of_requests_with_aborts_and_expiries_leave_nothing_held():
    rng = random.Random(7)
    pool = KVPool(1, 48, 1, BS, 1, torch.float32, cache_salt=salt_of("stress", "float32", BS))
    producer = LocalProducer(pool, lease_ttl_s=0.3)  # expiry every 0.5 s
    eng = Engine(MarkingRunner(pool), pool, producer, max_model_len=4096, vocab_size=VOCAB, token_budget=48,
                 max_num_seqs=8, max_queue_wait_s=60)
    eng.start()
    heads = [[rng.randrange(VOCAB) for _ in range(rng.randrange(8, 60))] for _ in range(6)]
    # working set: 6 heads x up to 15 blocks, plus tails, against 48 blocks
    inflight: dict[str, tuple] = {}
    kept: list[str] = []  # leases held a while, then released (or left to expire)
    counts = {"ok": 0, "aborted": 0, "expired_left": 0}
    try:
        for i in range(2500):
            ids = rng.choice(heads) + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 20))]
            rid = f"r{i}"
            inflight[rid] = (eng.submit(PrefillRequest(rid, tuple(ids))), ids)
            if rng.random() < 0.1:
                eng.abort(rid)  # queued, running, or (raced) just leased
            while len(inflight) >= 6 or (i == 2499 and inflight):
                done, _ = wait([f for f, _ in inflight.values()], timeout=30, return_when="FIRST_COMPLETED")
                assert done, "no request finished in 30 s"
                for rid_done in [r for r, (f, _) in inflight.items() if f in done]:
                    fut, prompt = inflight.pop(rid_done)
                    try:
                        res = fut.result()
                    except RequestCancelled:
                        counts["aborted"] += 1
                        continue
                    lease = pool.get_lease(rid_done)
                    if lease is None:  # aborted after it finished (the abort raced the result)
                        counts["aborted"] += 1
                        continue
                    k, _ = pool.read(0, lease.block_ids, len(prompt))
                    assert torch.equal(k[:, 0, 0], expected(prompt)), f"{rid_done}: another prompt's K/V"
                    assert res.num_cached_tokens % BS == 0 and res.num_cached_tokens < len(prompt)
                    counts["ok"] += 1
                    roll = rng.random()
                    if roll < 0.75:
                        eng.abort(rid_done)
                    elif roll < 0.8:
                        counts["expired_left"] += 1  # the lease expires
                    else:
                        kept.append(rid_done)
                    if len(kept) > 3:
                        eng.abort(kept.pop(rng.randrange(len(kept))))
            pool.check() if i % 250 == 0 else None
        for rid in kept:
            eng.abort(rid)
        deadline = time.monotonic() + 5
        while pool.num_leases and time.monotonic() < deadline:
            time.sleep(0.1)
        pool.check()
        assert pool.num_leases == 0 and pool.num_used == 0
        assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks))
        eng.refresh_metrics()
        m = eng.metrics
        hit_rate = m.prefix_cache_hits._value.get() / m.prefix_cache_queries._value.get()
        assert counts["ok"] > 1500 and counts["aborted"] > 50 and pool.expired_total > 30
        assert 0.3 < hit_rate < 0.95, hit_rate  # 6 heads of 8-60 tokens, tails of 0-19
        assert m.prefix_cache_evictions._value.get() > 100  # the pool is far smaller than the working set
    finally:
        eng.stop()

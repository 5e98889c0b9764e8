"""The prefix cache's host tier (engine/host_cache.py through KVPool): blocks the pool evicts are kept
in host memory under their names and brought back, bit for bit, into fresh blocks when a prompt's
cached head asks for them; bounded; nothing leaks or is held twice; and in the engine a head
evicted from a small pool is still a hit."""
import random

import pytest
import torch

from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.prefix_cache import block_hashes
from prefill_server.engine.types import PrefillRequest
from test_prefix_cache_engine import BS, make_engine

L, H, N, D = 2, 2, 4, 3
SALT = b"x" * 16


def pool(num_blocks: int, host_blocks: int) -> KVPool:
    per_block = L * H * N * 2 * D * 4
    return KVPool(L, num_blocks, H, N, D, torch.float32, cache_salt=SALT, host_cache_bytes=host_blocks * per_block)


def fill(p: KVPool, blocks: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in blocks:
        p.kv[:, b] = torch.randn(p.kv[:, b].shape, generator=g)


def cache_prompt(p: KVPool, tokens: list[int], seed: int) -> tuple[list[bytes], torch.Tensor]:
    """Compute (fill) and name the prompt's full blocks, then end the request: the blocks stay cached."""
    hashes = block_hashes(tokens, N, SALT)
    blocks = p.allocate(len(hashes))
    fill(p, blocks, seed)
    p.cache_blocks(blocks, hashes)
    pages = p.kv[:, blocks].clone()  # [L, n, H, N, 2D]
    p.free(blocks)
    return hashes, pages


def test_an_evicted_head_comes_back_bit_for_bit_from_host_memory():
    p = pool(num_blocks=4, host_blocks=8)
    a = list(range(3 * N))
    hashes, pages = cache_prompt(p, a, seed=1)
    other = p.allocate(4)  # the pool is full: A's three cached blocks are evicted (to the host tier)
    fill(p, other, seed=2)
    assert p.host.num_blocks == 3 and p.cache.num_cached == 0
    p.free(other)
    got = p.acquire_prefix(hashes)
    assert len(got) == 3 and p.host.num_blocks == 0 and p.host.restored == 3
    assert torch.equal(p.kv[:, got], pages)
    assert all(p.refcount(b) == 1 for b in got) and p.cache.match(hashes) == got  # named again, held once
    p.free(got)
    p.check()
    assert p.num_used == 0


def test_without_a_host_tier_an_evicted_head_is_gone():
    p = pool(num_blocks=4, host_blocks=0)
    assert p.host is None
    hashes, _ = cache_prompt(p, list(range(3 * N)), seed=1)
    p.free(p.allocate(4))
    assert p.acquire_prefix(hashes) == []


def test_a_run_continues_across_the_tiers_and_stops_where_neither_has_it():
    p = pool(num_blocks=6, host_blocks=8)
    a = list(range(5 * N))
    hashes, pages = cache_prompt(p, a, seed=3)
    # evict exactly two blocks: A's tail first (freed last blocks first), so the pool keeps A's head
    held = p.allocate(3)
    assert p.host.num_blocks == 2 and len(p.cache.match(hashes)) == 3
    p.free(held)
    got = p.acquire_prefix(hashes + [b"missing-name-xx!"])
    assert len(got) == 5 and torch.equal(p.kv[:, got], pages)
    p.free(got)
    p.check()


def test_the_tier_is_bounded_and_drops_its_oldest():
    p = pool(num_blocks=2, host_blocks=3)
    first, _ = cache_prompt(p, list(range(2 * N)), seed=1)
    second, pages = cache_prompt(p, list(range(100, 100 + 2 * N)), seed=2)  # evicts the first (2 -> host)
    p.free(p.allocate(2))  # evicts the second: the host tier holds 3, so the first stored goes
    assert p.host.num_blocks == 3 and p.host.dropped == 1
    head = p.acquire_prefix(first)  # a tail is evicted (and stored) before its head: the head is left
    assert len(head) == 1 and first[1] not in p.host
    p.free(head)
    got = p.acquire_prefix(second)
    assert len(got) == 2 and torch.equal(p.kv[:, got], pages)
    p.free(got)
    p.check()


def test_a_reset_empties_both_tiers():
    p = pool(num_blocks=2, host_blocks=4)
    hashes, _ = cache_prompt(p, list(range(2 * N)), seed=1)
    p.free(p.allocate(2))
    assert p.host.num_blocks == 2
    p.reset_cache()
    assert p.host.num_blocks == 0 and p.acquire_prefix(hashes) == []


def test_random_traffic_never_leaks_or_double_holds():
    rng = random.Random(0)
    p = pool(num_blocks=12, host_blocks=10)
    heads = [[rng.randrange(1000) for _ in range(rng.randint(1, 6) * N)] for _ in range(8)]
    truth: dict[bytes, torch.Tensor] = {}  # each name's K/V when it was computed
    held: list[list[int]] = []
    for step in range(1500):
        if held and (len(held) > 3 or rng.random() < 0.4):
            p.free(held.pop(rng.randrange(len(held))))
            continue
        tokens = rng.choice(heads) + [rng.randrange(1000) for _ in range(rng.randint(0, 2) * N)]
        hashes = block_hashes(tokens, N, SALT)
        got = p.acquire_prefix(hashes)
        for b, h in zip(got, hashes):  # a hit, from either tier, is what was computed under that name
            assert torch.equal(p.kv[:, b], truth[h]), f"step {step}: block {b} is not {h.hex()}'s K/V"
        try:
            new = p.allocate(len(hashes) - len(got))
        except Exception:
            p.free(got)
            continue
        fill(p, new, seed=step)
        for b, h in zip(new, hashes[len(got):]):
            truth.setdefault(h, p.kv[:, b].clone())
            if p.cache_blocks([b], [h]) == 0:  # named elsewhere already: ours is an ordinary block
                continue
            truth[h] = p.kv[:, b].clone()
        held.append(got + new)
        p.check()
    for blocks in held:
        p.free(blocks)
    p.check()
    assert p.num_used == 0 and p.host.restored > 0 and p.host.stored > 0


@pytest.fixture(scope="module")
def loaded():
    return build.load(EngineConfig(dtype="float32"))


def test_in_the_engine_a_head_evicted_from_a_small_pool_is_still_a_hit(loaded):
    """A pool of 16 blocks: prompt A (7 blocks), then B (16) evicts all of A; A again is a
    hit from the host tier, and its first token and K/V are those of a cold prefill."""
    text = loaded.tokenizer.encode(open("/usr/share/common-licenses/GPL-3").read()[:4000])
    a, b = text[:6 * BS + 5], text[300:300 + 16 * BS]  # b takes the whole pool
    assert len(b) == 16 * BS

    def run(eng, rid, ids):
        r = eng.submit(PrefillRequest(rid, tuple(ids))).result(120)
        kv = eng.pool.read(3, eng.pool.get_lease(rid).block_ids, len(ids))
        eng.pool.release(rid)
        return r, kv

    cold = make_engine(loaded, num_blocks=64)
    try:
        want, want_kv = run(cold, "cold", a)
    finally:
        cold.stop()
    results = {}
    for host in (0, 1):
        eng = make_engine(loaded, num_blocks=16, host_cache_gib=0.05 * host)  # 0.05 GiB: 72 blocks
        try:
            run(eng, "a1", a)
            run(eng, "b", b)
            results[host] = run(eng, "a2", a)
            eng.refresh_metrics()
            text = eng.metrics.render().decode()
            assert ("prefill_server:prefix_cache_host_restored_total 6.0" in text) == bool(host)
            eng.pool.check()
            assert eng.pool.num_used == 0
        finally:
            eng.stop()
    assert results[0][0].num_cached_tokens == 0  # no host tier: A's head was evicted
    hit, hit_kv = results[1]
    assert hit.num_cached_tokens == 6 * BS and hit.first_token_id == want.first_token_id
    assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(hit_kv, want_kv))

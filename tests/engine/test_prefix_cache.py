"""The prefix cache and the pool's reference counts: by hand, then against a reference model."""
import random
from collections import OrderedDict

import pytest
import torch

from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.prefix_cache import block_hashes, check_client_salt, salt_of, with_client_salt
from prefill_server.errors import InvalidRequest, PoolExhausted

SALT = salt_of("m", "float32", 4)


def make_pool(num_blocks=8, block_size=4, salt=SALT):
    return KVPool(1, num_blocks, 1, block_size, 2, torch.float32, cache_salt=salt)


def test_hashes_are_chained_salted_and_cover_full_blocks_only():
    ids = list(range(11))  # 2 full blocks of 4, and 3 tokens
    h = block_hashes(ids, 4, SALT)
    assert len(h) == 2 and len(set(h)) == 2
    assert block_hashes(ids, 4, SALT, limit=1) == h[:1]
    changed_second = block_hashes(ids[:5] + [99] + ids[6:], 4, SALT)
    assert changed_second[0] == h[0] and changed_second[1] != h[1]
    changed_first = block_hashes([99] + ids[1:], 4, SALT)
    assert changed_first[1] != h[1]  # the same tokens after a different head: another block
    for other in (salt_of("m2", "float32", 4), salt_of("m", "bfloat16", 4), salt_of("m", "float32", 8)):
        assert block_hashes(ids, 4, other)[0] != h[0]
    assert block_hashes([2**40, 3, 4, 5], 4, SALT)  # any id fits


def test_cached_blocks_survive_release_are_shared_and_evicted_last_unreferenced_first():
    pool = make_pool(num_blocks=4)
    ids = list(range(12))
    h = block_hashes(ids, 4, SALT)
    a = pool.allocate(3)
    assert pool.cache_blocks(a, h) == 3
    pool.free(a)  # cached, unreferenced: free to allocate, still named
    assert pool.num_used == 0 and pool.num_free == 4 and pool.cache.num_cached == 3
    hit = pool.acquire_prefix(h[:2])
    assert hit == a[:2] and [pool.refcount(b) for b in hit] == [1, 1]
    again = pool.acquire_prefix(h)  # a second holder of the same blocks
    assert again == a and pool.refcount(a[0]) == 2
    pool.free(again)
    # 2 blocks are allocatable: the free one, then the unreferenced cached a[2] (evicted)
    got = pool.allocate(2)
    assert a[2] in got and pool.cache.evictions == 1 and pool.cache.num_cached == 2
    with pytest.raises(PoolExhausted):
        pool.allocate(1)  # a[0], a[1] are held: never evicted
    assert pool.acquire_prefix(h) == a[:2]  # (the chain stops at the evicted block)
    pool.free(a[:2])
    pool.free(a[:2])
    pool.free(got)
    pool.check()
    assert pool.num_used == 0


def test_double_free_and_caching_an_unheld_block_fail():
    pool = make_pool()
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(b)
    with pytest.raises(AssertionError, match="no one holds"):
        pool.cache_blocks(b, block_hashes([1, 2, 3, 4], 4, SALT))


def test_a_hash_cached_twice_keeps_the_first_block():
    pool = make_pool()
    h = block_hashes([1, 2, 3, 4], 4, SALT)
    a, b = pool.allocate(1), pool.allocate(1)
    assert pool.cache_blocks(a, h) == 1 and pool.cache_blocks(b, h) == 0
    pool.free(b)  # an ordinary block: straight back to the free list
    pool.free(a)
    assert pool.cache.num_cached == 1 and pool.acquire_prefix(h) == a
    pool.free(a)
    pool.check()


def test_reset_forgets_everything_and_leaves_held_blocks_with_their_holders():
    pool = make_pool()
    h = block_hashes(list(range(8)), 4, SALT)
    a = pool.allocate(2)
    pool.cache_blocks(a, h)
    pool.free(a[1:])  # a[0] held, a[1] parked
    assert pool.reset_cache() == 1
    assert pool.cache.num_cached == 0 and pool.acquire_prefix(h) == []
    pool.free(a[:1])  # an ordinary block now
    pool.check()
    assert pool.num_free == 8


def test_without_a_salt_there_is_no_cache():
    pool = KVPool(1, 4, 1, 4, 2, torch.float32)
    assert pool.cache is None and pool.acquire_prefix([b"x"]) == [] and pool.reset_cache() == 0
    a = pool.allocate(2)
    assert pool.cache_blocks(a, [b"x", b"y"]) == 0
    pool.free(a)
    assert pool.num_free == 4


class ReferenceCache:
    """The cache's behaviour in hashes and counts alone (no block ids): free blocks, cached hashes
    with their holders, unreferenced cached hashes in LRU order."""

    def __init__(self, num_blocks):
        self.free = num_blocks
        self.holders: dict[bytes, int] = {}
        self.lru: OrderedDict[bytes, None] = OrderedDict()

    def available(self):
        return self.free + len(self.lru)

    def lookup(self, hashes):
        hit = []
        for h in hashes:
            if h not in self.holders:
                break
            if self.holders[h] == 0:
                del self.lru[h]
            self.holders[h] += 1
            hit.append(h)
        return hit

    def allocate(self, n):
        assert n <= self.available()
        for _ in range(n):
            if self.free:
                self.free -= 1
            else:
                h, _ = self.lru.popitem(last=False)
                del self.holders[h]

    def insert(self, h):
        """True if a new block is named (else the request's block stays ordinary)."""
        if h in self.holders:
            return False
        self.holders[h] = 1
        return True

    def release(self, blocks):  # [(hash or None)] of one request, in prompt order
        for h in reversed(blocks):
            if h is None:
                self.free += 1
                continue
            self.holders[h] -= 1
            if self.holders[h] == 0:
                self.lru[h] = None


@pytest.mark.parametrize("seed", range(5))
def test_pool_matches_the_reference_model(seed):
    """Random prompts from a few heads, held for a while, on a pool far smaller than the working
    set: the same hits and free counts as the reference, and every hit block holds what its hash
    names (a marker written when it was computed: nothing in use was ever reused)."""
    rng = random.Random(seed)
    bs, nb = 4, 24
    pool, ref = make_pool(num_blocks=nb, block_size=bs), ReferenceCache(nb)
    heads = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    content: dict[int, bytes] = {}  # block -> the hash of the K/V it holds
    held: list[tuple[list[int], list]] = []  # per live request: its blocks, their names in the reference
    for step in range(3000):
        if held and (rng.random() < 0.45 or len(held) > 6):
            blocks, names = held.pop(rng.randrange(len(held)))
            pool.free(blocks)
            ref.release(names)
        else:
            ids = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
            hashes = block_hashes(ids, bs, SALT)
            limit = (len(ids) - 1) // bs  # the last token is always computed
            hit = pool.acquire_prefix(hashes[:limit])
            ref_hit = ref.lookup(hashes[:limit])
            assert len(hit) == len(ref_hit)
            for b, h in zip(hit, hashes):
                assert content[b] == h, "a cached block was reused while named"
            need = pool.blocks_needed(len(ids)) - len(hit)
            if need > pool.num_free:
                assert need > ref.available()
                pool.free(hit)
                ref.release(ref_hit)
                continue
            new = pool.allocate(need)
            ref.allocate(need)
            blocks = hit + new
            for i in range(len(hit), len(blocks)):  # "compute" the new blocks
                content[blocks[i]] = hashes[i] if i < len(hashes) else b"partial"
            full = len(hashes)
            pool.cache_blocks(blocks[len(hit):full], hashes[len(hit):full])
            names = list(ref_hit) + [h if ref.insert(h) else None for h in hashes[len(hit):full]]
            names += [None] * (len(blocks) - len(names))
            held.append((blocks, names))
        assert pool.num_free == ref.available()
        if step % 100 == 0:
            pool.check()
    for blocks, names in held:
        pool.free(blocks)
        ref.release(names)
    pool.check()
    assert pool.num_used == 0 and all(pool.refcount(b) == 0 for b in range(nb))
    assert pool.cache.evictions > 0


def test_a_client_salt_roots_its_own_chains():
    root = salt_of("m", "torch.float32", 4)
    assert with_client_salt(root, None) == root  # no salt: the model's own chains
    a, b = with_client_salt(root, "tenant-a"), with_client_salt(root, "tenant-b")
    assert len({root, a, b}) == 3 and with_client_salt(root, "tenant-a") == a
    ids = list(range(12))
    chains = [block_hashes(ids, 4, r) for r in (root, a, b)]
    assert all(len(c) == 3 for c in chains)
    assert not set(chains[0]) & set(chains[1]) and not set(chains[1]) & set(chains[2])  # no block shared
    for ok in ("s", "x" * 128, "base64url_-=+"):
        assert check_client_salt(ok) == ok
    assert check_client_salt(None) is None
    for bad in ("", "x" * 129, "a/b", "a@b", "a\\b", "a\x00b", 5, ["s"]):  # vLLM's validate_cache_salt
        with pytest.raises(InvalidRequest) as ei:
            check_client_salt(bad)
        assert ei.value.field == "cache_salt"

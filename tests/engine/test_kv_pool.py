import time

import pytest
import torch

from prefill_server.engine.kv_pool import KVPool
from prefill_server.errors import PoolExhausted


def make_pool(num_blocks=8, block_size=4, heads=2, dim=3, layers=2):
    return KVPool(layers, num_blocks, heads, block_size, dim, torch.float32)


def test_allocate_free_and_exhaustion():
    pool = make_pool()
    a = pool.allocate(5)
    assert len(set(a)) == 5 and pool.num_used == 5
    with pytest.raises(PoolExhausted, match="3 free blocks, 4 needed"):
        pool.allocate(4)
    pool.free(a)
    assert pool.num_used == 0


def test_write_read_roundtrip_matches_page_layout():
    pool = make_pool()
    blocks = pool.allocate(3)
    t = 10  # spans 3 blocks of 4
    k, v = torch.randn(t, 2, 3), torch.randn(t, 2, 3)
    b, o = pool.slot_mapping(blocks, 0, t)
    pool.write(1, b, o, k, v)
    rk, rv = pool.read(1, blocks, t)
    torch.testing.assert_close(rk, k)
    torch.testing.assert_close(rv, v)
    # page layout [H, N, K|V]: token 5 lives in blocks[1] at slot 1
    page = pool.kv[1, blocks[1]]
    torch.testing.assert_close(page[:, 1, :3], k[5])
    torch.testing.assert_close(page[:, 1, 3:], v[5])
    assert pool.layer_base_addr(1) - pool.layer_base_addr(0) == pool.layer_bytes
    assert pool.block_bytes == 2 * 4 * 6 * 4


def test_chunked_writes_equal_one_write():
    pool = make_pool()
    blocks = pool.allocate(3)
    k, v = torch.randn(11, 2, 3), torch.randn(11, 2, 3)
    for s, e in [(0, 3), (3, 8), (8, 11)]:
        b, o = pool.slot_mapping(blocks, s, e)
        pool.write(0, b, o, k[s:e], v[s:e])
    rk, rv = pool.read(0, blocks, 11)
    torch.testing.assert_close(rk, k)
    torch.testing.assert_close(rv, v)


def test_lease_release_extend_expire():
    pool = make_pool()
    pool.lease("a", pool.allocate(2), ttl_s=0.05)
    pool.lease("b", pool.allocate(3), ttl_s=60)
    assert pool.num_used == 5 and pool.num_leases == 2
    assert pool.extend("b", 120) and not pool.extend("zzz", 1)
    time.sleep(0.06)
    assert pool.expire() == ["a"]
    assert pool.expired_total == 1 and pool.num_used == 3
    assert pool.release("b") and not pool.release("b")
    assert pool.num_used == 0


def test_lease_end_hook_sees_release_and_expiry():
    pool = make_pool()
    seen = []
    pool.on_lease_end = lambda lease, expired: seen.append((lease.request_id, expired))
    pool.lease("r", pool.allocate(1), ttl_s=60)
    pool.lease("e", pool.allocate(1), ttl_s=0.0)
    pool.expire()
    pool.release("r")
    assert seen == [("e", True), ("r", False)] and pool.num_used == 0

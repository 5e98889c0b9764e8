"""Real NIXL over UCX on DRAM into decode caches laid out as vLLM 0.32 lays them out, in every
``KVCacheLayout``: push (the producer WRITEs layer by layer) and pull (the decode READs leased
blocks). The bytes are checked where the decode's kernels read them: by offset arithmetic on the
raw buffer and through FLASH_ATTN's own view of the cache."""
from __future__ import annotations

import time

import msgspec
import pytest
import torch

from kv_transfer import wire
from kv_transfer.push import PushProducer
from kv_transfer.receiver import PushReceiver
from kv_transfer.wire import PARAMS_KEY
from decode_side import ORDER, Views, ask, wait_done, wait_until
from prefill_server.engine.kv_pool import KVPool

SECRET = b"layout-test-secret-0123"
L, H, N, D = 3, 2, 16, 8
T = 5 * N - 3  # 5 blocks, the last one partly filled


def geometry(dtype="float32"):
    return wire.Geometry(model_fingerprint="layout-test", num_layers=L, num_kv_heads=H, head_dim=D,
                         block_size=N, dtype=dtype)


@pytest.fixture(scope="module")
def producer():
    pool = KVPool(L, 32, H, N, D, torch.float32)
    p = PushProducer(pool, geometry(), SECRET, lease_ttl_s=30.0, transfer_timeout_s=20.0)
    p.start()
    yield p
    p.stop()


def expected(pool: KVPool, pages_of_layer) -> list[torch.Tensor]:
    """Per layer, [T, H, 2D] of the tokens held by the pool pages (flat page indices)."""
    flat = pool.kv.view(-1, H, N, 2 * D)
    return [flat[pages_of_layer(layer)].permute(0, 2, 1, 3).reshape(-1, H, 2 * D)[:T] for layer in range(L)]


def check_landed(v: Views, blocks, want, untouched):
    for layer in range(L):
        k, val = v.read_raw(layer, blocks, T)
        torch.testing.assert_close(k, want[layer][..., :D], rtol=0, atol=0)
        torch.testing.assert_close(val, want[layer][..., D:], rtol=0, atol=0)
        fk, fv = v.read_like_flash_attn(layer, blocks, T)
        torch.testing.assert_close(fk, want[layer][..., :D], rtol=0, atol=0)
        torch.testing.assert_close(fv, want[layer][..., D:], rtol=0, atol=0)
        assert float(v.caches[layer][untouched].abs().sum()) == 0, "bytes landed outside the request's blocks"


def decode(name: str, dtype=torch.float32) -> tuple[Views, PushReceiver]:
    v = Views(name, L, 12, H, N, D, dtype)
    return v, PushReceiver(v.caches, geometry(str(dtype).removeprefix("torch.")), SECRET, timeout_s=20,
                           layout_name=name)


@pytest.mark.parametrize("name", sorted(ORDER))
def test_push_lands_in_every_layout(producer, name):
    v, recv = decode(name)
    rid = f"push-{name}"
    try:
        pool = producer.pool
        staging = pool.allocate(4)
        pages = pool.stream_pages(staging, T, 0, 1)[:5]  # one slot: 5 flat pages
        pool.kv.view(-1, H, N, 2 * D)[pages] = torch.randn(len(pages), H, N, 2 * D)
        blocks = [9, 2, 3, 4, 7]  # the decode's, in any order
        p = producer.expect(rid, T)[PARAMS_KEY]
        recv.register(p["host"], p["port"], rid, blocks, 0, T)
        assert wait_until(lambda: producer.is_ready(rid), 20)
        for layer in range(L):
            producer.layer_done(rid, layer, pages)
        producer.finish(rid)
        assert wait_done(recv, rid) == "done"
        want = expected(pool, lambda layer: pages)
        check_landed(v, blocks, want, [0, 1, 5, 6, 8, 10, 11])
        pool.free(staging)
    finally:
        recv.close()


@pytest.mark.parametrize("name", sorted(ORDER))
def test_pull_reads_into_every_layout(producer, name):
    v, recv = decode(name)
    rid = f"pull-{name}"
    try:
        pool = producer.pool
        own = pool.allocate(5)  # the prefill's blocks, holding the whole prompt in every layer
        for layer in range(L):
            pool.kv[layer, own] = torch.randn(5, H, N, 2 * D)
        want = expected(pool, lambda layer: [layer * pool.num_blocks + b for b in own])
        blocks = [11, 0, 5, 6, 1]
        p = producer.expect(rid, T)[PARAMS_KEY]
        recv.register(p["host"], p["port"], rid, blocks, 0, T, mode="pull")
        assert wait_until(lambda: producer.is_ready(rid), 20) and producer.wants_pull(rid)
        producer.publish(rid, own, T)
        assert wait_done(recv, rid) == "done"
        check_landed(v, blocks, want, [2, 3, 4, 7, 8, 9, 10])
        deadline = time.monotonic() + 10  # the READ's notification frees the lease
        while pool.num_used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.num_used == 0 and producer.num_active == 0
    finally:
        recv.close()


def test_bf16_pages_into_a_token_major_cache():
    pool = KVPool(L, 16, H, N, D, torch.bfloat16)
    prod = PushProducer(pool, geometry("bfloat16"), SECRET, transfer_timeout_s=20.0)
    prod.start()
    v, recv = decode("LBNHC", torch.bfloat16)
    try:
        own = pool.allocate(5)
        pool.kv[:, own] = torch.randn(L, 5, H, N, 2 * D).to(torch.bfloat16)
        want = expected(pool, lambda layer: [layer * pool.num_blocks + b for b in own])
        p = prod.expect("bf", T)[PARAMS_KEY]
        recv.register(p["host"], p["port"], "bf", [7, 6, 5, 4, 3], 0, T, mode="pull")
        assert wait_until(lambda: prod.is_ready("bf"), 20)
        prod.publish("bf", own, T)
        assert wait_done(recv, "bf") == "done"
        check_landed(v, [7, 6, 5, 4, 3], want, [0, 1, 2, 8, 9, 10, 11])
    finally:
        recv.close()
        prod.stop()



def test_bad_strides_and_other_versions_are_refused_with_what_to_change(producer):
    producer.expect("bad", T)
    g = msgspec.structs.replace(geometry(), page_layout="LBNHC")
    reg = wire.Register(version=wire.PROTOCOL_VERSION, request_id="bad", engine_id="e", agent_name="e",
                        agent_metadata=b"", geometry=g, mem_type="DRAM", device_id=0, layer_addrs=[0] * L,
                        block_stride=H * N * 2 * D * 4, head_stride=N * 2 * D * 4, token_stride=2 * D * 4,
                        block_ids=list(range(5)), first_token=0, num_tokens=T, nonce=wire.new_nonce(),
                        timestamp=time.time())
    ack = ask(producer.port, wire.sign(SECRET, reg))  # [H, N, C] strides under a [N, H, C] name
    assert not ack.accepted and "do not fit page layout LBNHC" in ack.error
    old = msgspec.structs.replace(reg, version=1, nonce=wire.new_nonce())
    ack = ask(producer.port, wire.sign(SECRET, old))
    assert not ack.accepted and "protocol version 1 not supported" in ack.error and ack.mac == b""
    assert producer.abort("bad")

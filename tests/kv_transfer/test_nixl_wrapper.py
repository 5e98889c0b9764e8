"""NIXL over UCX on DRAM: our agent wrapper, and the producer with a fake decode agent that does
what vLLM's NixlConnector does (load our metadata, READ the blocks, notify, heartbeat)."""
from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
import torch

from decode_side import get_meta
from kv_transfer.base import TransferState
from kv_transfer.nixl import NixlAgent
from kv_transfer.vllm import nixl_wire, v0_32
from kv_transfer.vllm.nixl_compat import NixlCompatProducer
from kv_transfer.vllm.nixl_decode import DecodeInfo
from prefill_server.engine.kv_pool import KVPool


# ---- the test's own descriptor helpers (the decode's side, as vLLM builds it) ----
def coalesce_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[(first_block, count), ...] for the maximal runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((int(b), 1))
    return runs


def block_descs(base_addrs: Sequence[int], block_bytes: int, block_stride: int,
                block_ids: Sequence[int], device_id: int = 0) -> np.ndarray:
    """Nx3 uint64 descriptors (addr, len, dev) for block_ids in every region of base_addrs, one
    descriptor per run of contiguous blocks when block_stride == block_bytes."""
    if block_stride == block_bytes:
        runs = coalesce_runs(block_ids)
    else:
        runs = [(int(b), 1) for b in block_ids]
    rows = [(base + first * block_stride, count * block_bytes, device_id)
            for base in base_addrs for first, count in runs]
    return np.asarray(rows, dtype=np.uint64).reshape(-1, 3)


def wait_notif(agent: NixlAgent, predicate, timeout_s: float) -> tuple[str, bytes]:
    """Poll until a notification satisfies predicate(agent, msg); others are dropped."""
    deadline = time.monotonic() + timeout_s
    while True:
        for name, msg in agent.get_notifs():
            if predicate(name, msg):
                return name, msg
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no matching NIXL notification within {timeout_s} s")
        time.sleep(0.001)


def test_coalesce_runs_and_descs():
    assert coalesce_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert coalesce_runs([]) == []
    d = block_descs([1000, 5000], 10, 10, [3, 4, 7])
    assert d.tolist() == [[1030, 20, 0], [1070, 10, 0], [5030, 20, 0], [5070, 10, 0]]
    d = block_descs([0], 10, 16, [3, 4])  # strided blocks are not merged
    assert d.tolist() == [[48, 10, 0], [64, 10, 0]]


def test_register_once_and_close():
    t = torch.arange(64, dtype=torch.float32)
    with NixlAgent("wrap-a") as a:
        a.register(t)
        with pytest.raises(RuntimeError, match="once"):
            a.register(t)
        assert a.metadata()
    a.close()  # idempotent


def test_read_between_two_agents_with_notification():
    src = torch.arange(4 * 16, dtype=torch.float32).reshape(4, 16)
    dst = torch.zeros(4, 16)
    # nobody polls the target while the initiator waits: it needs NIXL's progress thread
    with NixlAgent("wrap-src", progress_thread=True) as a, NixlAgent("wrap-dst") as b:
        a.register(src)
        b.register(dst)
        peer = b.add_remote(a.metadata())
        row = 16 * 4
        local = block_descs([dst.data_ptr()], row, row, [0, 1])
        remote = block_descs([src.data_ptr()], row, row, [2, 3])
        assert b.transfer("READ", local, remote, peer, notif=b"done:1", timeout_s=10) == 2 * row
        assert torch.equal(dst[:2], src[2:]) and not dst[2:].any()
        agent, msg = wait_notif(a, lambda ag, m: m == b"done:1", timeout_s=10)
        assert agent == "wrap-dst"


class FakeVllmDecode:
    """Plays a vLLM 0.32 NixlConnector consumer: side-channel handshake, READ, notify."""

    def __init__(self, name: str, pool_like: KVPool):
        self.cache = torch.zeros_like(pool_like.kv)
        self.agent = NixlAgent(name)
        self.agent.register(self.cache)
        self.meta: nixl_wire.NixlAgentMetadata | None = None
        self.peer = ""

    def handshake(self, host: str, port: int) -> str:
        payload_bytes, _ts = get_meta(port, host)
        payload = msgspec.msgpack.Decoder(nixl_wire.NixlHandshakePayload).decode(payload_bytes)
        self.meta = msgspec.msgpack.Decoder(nixl_wire.NixlAgentMetadata).decode(payload.agent_metadata_bytes)
        self.peer = self.agent.add_remote(self.meta.agent_metadata)
        return payload.compatibility_hash

    def read(self, params: dict, local_blocks: list[int]) -> None:
        m = self.meta
        assert m is not None
        remote_blocks = params["remote_block_ids"][0]
        local = np.concatenate([block_descs([self.cache[i].data_ptr()], m.block_lens[i], m.block_strides[i],
                                            local_blocks) for i in range(len(m.block_lens))])
        remote = np.concatenate([block_descs([m.kv_caches_base_addr[i]], m.block_lens[i], m.block_strides[i],
                                             remote_blocks) for i in range(len(m.block_lens))])
        self.agent.transfer("READ", local, remote, self.peer,
                            notif=f"{params['remote_request_id']}:1".encode(), timeout_s=10)

    def close(self) -> None:
        self.agent.close()


def test_producer_serves_a_fake_vllm_decode():
    pool = KVPool(3, 12, 2, 16, 8, torch.float32)
    info = DecodeInfo(wire=v0_32.WIRE, url="http://d", vllm_version="0.32.0", model="/m", served_model_name="m",
                            attn_backend_name="CPU_ATTN", block_size=16)
    with NixlCompatProducer(pool, info, expiry_interval_s=0.05) as prod:
        decode = FakeVllmDecode("fake-decode", pool)
        try:
            blocks = pool.allocate(3)
            pool.kv[:, blocks] = torch.randn(3, 3, 2, 16, 16)
            params = prod.publish("rq", blocks, 40)
            assert decode.handshake(params["remote_host"], params["remote_port"]) == \
                nixl_wire.compatibility_hash(info.factors(pool))
            # the decode heartbeats while queued, then reads into its own blocks 5, 6, 7
            decode.agent.send_notif(decode.peer, b"HB:rq")
            t0 = time.monotonic()
            decode.read(params, [5, 6, 7])
            assert time.monotonic() - t0 < 5.0
            assert torch.equal(decode.cache[:, 5:8], pool.kv[:, blocks])
            end = time.monotonic() + 10
            while pool.num_used and time.monotonic() < end:
                time.sleep(0.01)
            assert pool.num_used == 0 and prod.state("rq") is TransferState.RELEASED
            s = prod.stats()
            assert (s.handshakes_total, s.heartbeats_total, s.released_total) == (1, 1, 1)
        finally:
            decode.close()

"""``SGLangProducer`` against a stand-in decode in this venv (NIXL/UCX on DRAM, zmq): its buffers
laid out as SGLang 0.5.23's (K per layer, then V, ``[pages * page_size, heads, head_dim]``; the
metadata buffers), its messages built per the wire. The same paths with SGLang's own classes:
test_sglang_decode.py (slow, .venv-sglang)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import zmq

from kv_transfer.base import TransferState
from kv_transfer.nixl import NixlAgent
from kv_transfer.sglang import SGLangProducer
from kv_transfer.sglang import v0_5_23 as wire
from prefill_server.engine.kv_pool import KVPool
from prefill_server.errors import InvalidRequest, RequestCancelled, TransferError
from test_sglang_wire import registration_frames, transfer_info_frames

L, H, D, N, PS = 3, 2, 8, 16, 4  # layers, KV heads, head_dim, our block size, the decode's page size
AUX_FIELDS = [("<i4", 16), ("<i4", 16), ("<f4", 16), ("<i4", 16), ("<f4", 128), ("<i4", 128), ("<f4", 16),
              ("<i8", 16), ("<f4", 16), ("<u8", 8)]  # MetadataBuffers' default buffers, in order


class FakeDecode:
    """An SGLang-shaped decode rank: registered DRAM, a PULL socket for our messages."""

    def __init__(self, prefill: SGLangProducer, pages: int = 64, rows: int = 8, page_size: int = PS):
        self.kv = torch.zeros(2, L, (pages + 1) * page_size, H, D)  # [K|V, layer, slots, H, D]
        self.aux = [torch.zeros(rows, w, dtype=getattr(torch, {"<i4": "int32", "<f4": "float32", "<i8": "int64",
                                                                    "<u8": "uint64"}[t])) for t, w in AUX_FIELDS]
        self.agent = NixlAgent(f"fake-decode-{uuid.uuid4()}", progress_thread=True)  # (as SGLang's decode: UCX over TCP needs the target to progress)
        self.agent.register([self.kv, *self.aux])
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(f"tcp://127.0.0.1:{prefill.rank_port}")
        self.page_size = page_size

    def register(self, **kw):
        ptrs = [self.kv[0, i].data_ptr() for i in range(L)] + [self.kv[1, i].data_ptr() for i in range(L)]
        args = dict(endpoint="127.0.0.1", port=self.port, agent=self.agent.name, metadata=self.agent.metadata(),
                    kv_ptrs=ptrs, aux_ptrs=[a.data_ptr() for a in self.aux], item_len=self.page_size * H * D * 4,
                    num_slots=self.kv.shape[2] // self.page_size)
        self.push.send_multipart(registration_frames(**{**args, **kw}))

    def transfer_info(self, room, pages, aux=0, prefix=0, **kw):
        self.push.send_multipart(transfer_info_frames(room, pages, endpoint="127.0.0.1", port=self.port,
                                                      agent=self.agent.name, aux=aux, prefix=prefix, **kw))

    def receive(self, timeout_s=10.0) -> list[bytes]:
        if not self.pull.poll(int(timeout_s * 1000)):
            raise TimeoutError("no message from the prefill")
        return self.pull.recv_multipart()

    def rows(self, pages, n):  # [L, 2, n, H, D] the decode holds for tokens of these pages
        idx = torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])
        return self.kv[:, :, idx].permute(1, 0, 2, 3, 4)[:, :, :n]

    def close(self):
        self.pull.close(0)
        self.push.close(0)
        self.ctx.term()
        self.agent.close()


@pytest.fixture()
def prefill():
    pool = KVPool(L, 32, H, N, D)
    producer = SGLangProducer(pool, page_size=PS, bootstrap_port=0, transfer_timeout_s=5.0)
    producer.start()
    yield producer
    producer.stop()


@pytest.fixture()
def decode(prefill):
    d = FakeDecode(prefill)
    d.register()
    yield d
    d.close()


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Engine:
    """What the engine's streamed forward does with a producer: two staging slots of pool pages,
    K/V of layer l written into slot l % 2 after the WRITE of layer l - 2, then layer_done."""

    def __init__(self, producer, rid, n):
        self.p, self.rid, self.n, self.pool = producer, rid, n, producer.pool
        self.blocks = self.pool.allocate(self.pool.stream_blocks_needed(n, 2))
        self.pages = [self.pool.stream_pages(self.blocks, n, s, 2) for s in range(2)]
        self.kv = torch.randn(L, 2, n, H, D)

    def layer(self, layer):
        if layer >= 2:
            self.p.wait_layer(self.rid, layer - 2)
        pos = torch.arange(self.n)
        self.pool.write_flat(torch.tensor(self.pages[layer % 2])[pos // N], pos % N, self.kv[layer, 0],
                             self.kv[layer, 1])
        self.p.layer_done(self.rid, layer, self.pages[layer % 2])

    def run(self, **finish):
        for layer in range(L):
            self.layer(layer)
        return self.p.finish(self.rid, **finish)

    def free(self):
        self.pool.free(self.blocks)


def test_layers_and_aux_rows_land_in_sglang_layout_bit_equal(prefill, decode):
    n, room, pages = 22, 4242, [7, 8, 9, 20, 3, 30]  # runs 7-9 | 20 | 3 | 30 (last page partial)
    params = prefill.expect("a1", n, bootstrap_room=room)
    assert params == {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
    decode.transfer_info(room, pages, aux=5)
    wait_for(lambda: prefill.is_ready("a1"))
    eng = Engine(prefill, "a1", n)
    eng.run(first_token=31, logprobs=((31, -0.25), (31, -0.25), (2, -2.0)), cached_tokens=0)
    eng.free()
    assert decode.receive() == [b"KV_STATUS", str(room).encode(), b"4", b"0", b""]
    assert torch.equal(decode.rows(pages, n), eng.kv)  # every layer's K and V, bit-equal
    assert int(decode.aux[0][5, 0]) == 31 and int(decode.aux[9][5, 0]) == room
    assert float(decode.aux[2][5, 0]) == -0.25 and decode.aux[5][5, :2].tolist() == [31, 2]
    assert int(decode.aux[9][4, 0]) == 0  # other rows untouched
    assert prefill.state("a1") is TransferState.RELEASED and prefill.num_active == 0
    # one descriptor per run of consecutive pages, for K and for V, per layer
    assert prefill.stats().bytes_offered_total == L * 2 * n * H * D * 4


def test_the_decode_may_come_first_and_hold_a_prefix(prefill, decode):
    n, room = 13, 77
    decode.kv[:, :, 4:8] = 5.0  # page 1: the 4 tokens the decode already holds
    decode.transfer_info(room, [2, 3, 4], aux=1, prefix=4)  # before the prefill's request
    time.sleep(0.5)  # (parked by the service thread meanwhile; either order works)
    prefill.expect("b1", n, bootstrap_room=room)
    wait_for(lambda: prefill.is_ready("b1"))
    eng = Engine(prefill, "b1", n)
    eng.run(first_token=1)
    assert decode.receive()[2] == b"4"
    assert torch.equal(decode.rows([2, 3, 4], n - 4), eng.kv[:, :, 4:])
    assert bool((decode.kv[:, :, 4:8] == 5.0).all())


def test_a_decode_holding_the_whole_prompt_gets_the_aux_rows_only(prefill, decode):
    prefill.expect("b2", 8, bootstrap_room=78)
    decode.transfer_info(78, [], aux=2, prefix=8)  # its radix cache hit all 8 tokens
    wait_for(lambda: prefill.is_ready("b2"))
    Engine(prefill, "b2", 8).run(first_token=9)
    assert decode.receive()[2] == b"4" and int(decode.aux[0][2, 0]) == 9 and int(decode.aux[9][2, 0]) == 78
    assert prefill.stats().bytes_offered_total == 0


DYING_DECODE = """
import sys, time
sys.path.insert(0, sys.argv[1])
from test_sglang_producer import FakeDecode
class P:
    rank_port = int(sys.argv[2])
d = FakeDecode(P())
d.register()
d.transfer_info(int(sys.argv[3]), [1, 2, 3])
print("sent", flush=True)
time.sleep(600)
"""


def test_a_decode_that_dies_mid_stream_frees_our_blocks(prefill):
    prefill.expect("b3", 9, bootstrap_room=79)
    proc = subprocess.Popen([sys.executable, "-c", DYING_DECODE, os.path.dirname(__file__), str(prefill.rank_port),
                             "79"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "sent"
        wait_for(lambda: prefill.is_ready("b3"), 30)
        eng = Engine(prefill, "b3", 9)
        eng.layer(0)
        prefill.wait_layer("b3", 0)
        proc.kill()
        proc.wait(10)
        with pytest.raises(TransferError):  # a WRITE error, or given up after transfer_timeout_s
            eng.layer(1)
            eng.layer(2)
            prefill.finish("b3", first_token=1)
        freed = threading.Event()
        prefill.abort("b3", "transfer failed", on_idle=lambda: (eng.free(), freed.set()))
        assert freed.wait(10) and prefill.num_active == 0 and prefill.pool.num_used == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_junk_on_the_rank_socket_changes_nothing(prefill, decode):
    for frames in ([b"junk"], [wire.GUARD, b"None", b"x"], [wire.ABORT, b"nope"], [b""] * 70,
                   transfer_info_frames(5, [1])[:-2], [wire.GUARD] + [b"\xff" * 9] * 10):
        decode.push.send_multipart(frames)
    decode.register(kv_ptrs=[1, 2, 3], item_len=7)  # malformed in meaning: a refused peer, not a crash
    wait_for(lambda: prefill.malformed_total >= 5)
    decode.register()  # (re-registers the usable peer)
    prefill.expect("c1", 5, bootstrap_room=5)
    decode.transfer_info(5, [1, 2])
    wait_for(lambda: prefill.is_ready("c1"))
    Engine(prefill, "c1", 5).run(first_token=0)
    assert decode.receive()[2] == b"4"


def test_a_decode_abort_mid_stream_is_acked_once_no_write_is_in_flight(prefill, decode):
    prefill.expect("d1", 9, bootstrap_room=9)
    decode.transfer_info(9, [1, 2, 3])
    wait_for(lambda: prefill.is_ready("d1"))
    eng = Engine(prefill, "d1", 9)
    eng.layer(0)
    prefill.wait_layer("d1", 0)
    decode.push.send_multipart([wire.ABORT, b"9", b"127.0.0.1", str(decode.port).encode(), b"7"])
    assert decode.receive() == [b"ABORT_ACK", b"9", b"0", b"7"]
    with pytest.raises((TransferError, RequestCancelled)):
        eng.layer(1)
        prefill.wait_layer("d1", 1)
    freed = threading.Event()
    prefill.abort("d1", "the decode aborted", on_idle=freed.set)
    assert freed.wait(5) and prefill.num_active == 0
    with pytest.raises(TimeoutError):
        decode.receive(0.3)  # no KV_STATUS after the decode's own abort


def test_a_transfer_info_that_does_not_fit_fails_the_room_with_a_reason(prefill, decode):
    prefill.expect("e1", 20, bootstrap_room=11)
    decode.transfer_info(11, [1, 2])  # 20 tokens need 5 pages of 4
    status = decode.receive()
    assert status[:4] == [b"KV_STATUS", b"11", b"0", b"0"] and b"needs 5" in status[4]
    assert "needs 5" in prefill.overdue("e1")
    freed = threading.Event()
    prefill.abort("e1", "failed", on_idle=freed.set)
    assert freed.wait(5)
    with pytest.raises(TimeoutError):
        decode.receive(0.3)  # (told once)


def test_unregistered_decodes_and_unclaimed_rooms_get_a_failed_status(decode):
    pool = KVPool(L, 32, H, N, D)
    prefill = SGLangProducer(pool, page_size=PS, bootstrap_port=0, bootstrap_timeout_s=0.5)
    prefill.start()
    try:
        stranger = FakeDecode(prefill)  # never registers
        stranger.transfer_info(12, [1])
        prefill.expect("f1", 3, bootstrap_room=12)
        status = stranger.receive()
        assert status[2] == b"0" and b"never registered" in status[4]
        stranger.register()
        stranger.transfer_info(13, [1])  # no request for room 13 ever comes
        status = stranger.receive(5)
        assert status[:3] == [b"KV_STATUS", b"13", b"0"] and b"no request with bootstrap_room 13" in status[4]
        prefill.expect("f2", 3, bootstrap_room=14)
        time.sleep(0.6)
        assert "within 0 s" in prefill.overdue("f2") or "within 1 s" in prefill.overdue("f2")
        stranger.close()
    finally:
        prefill.stop()


def test_a_prefill_failure_reports_the_failed_status(prefill, decode):
    prefill.expect("g1", 9, bootstrap_room=21)
    decode.transfer_info(21, [1, 2, 3])
    wait_for(lambda: prefill.is_ready("g1"))
    eng = Engine(prefill, "g1", 9)
    eng.layer(0)
    freed = threading.Event()
    prefill.abort("g1", "prefill failed: the forward raised", on_idle=freed.set)
    assert freed.wait(5)
    status = decode.receive()
    assert status[:3] == [b"KV_STATUS", b"21", b"0"] and status[4] == b"prefill failed: the forward raised"
    # a finish without the first token is a failure too, never a hang
    prefill.expect("g2", 4, bootstrap_room=22)
    decode.transfer_info(22, [4])
    wait_for(lambda: prefill.is_ready("g2"))
    with pytest.raises(TransferError, match="first token"):
        Engine(prefill, "g2", 4).run()
    prefill.abort("g2")
    assert b"first token" in decode.receive()[4]


def test_a_decode_of_another_geometry_is_refused_at_its_first_room(prefill, decode):
    decode.register(item_len=PS * H * D * 2)  # bf16 pages behind the same "auto" dtype string
    prefill.expect("h1", 4, bootstrap_room=31)
    decode.transfer_info(31, [1])
    status = decode.receive()
    assert status[2] == b"0" and b"--page-size and KV dtype" in status[4]


def test_expect_checks_its_arguments(prefill):
    with pytest.raises(InvalidRequest, match="1..2"):
        prefill.expect("i1", 4, bootstrap_room=0)
    prefill.expect("i2", 4, bootstrap_room=41)
    with pytest.raises(InvalidRequest, match="already in use"):
        prefill.expect("i3", 4, bootstrap_room=41)
    with pytest.raises(InvalidRequest, match="streams 1.."):
        prefill.expect("i4", 10**7)
    assert 1 <= prefill.expect("i5", 4)["bootstrap_room"] <= wire.MAX_ROOM
    assert np.isin(prefill.stats().published_total, [2])


@pytest.mark.parametrize("pages_of", [lambda bs: bs, lambda bs: bs[::-1]], ids=["consecutive", "scattered"])
def test_a_layer_is_converted_to_token_major_k_and_v(pages_of):
    from kv_transfer.sglang.target import ConvertArea

    pool = KVPool(L, 32, H, N, D)
    pool.kv.copy_(torch.randn_like(pool.kv))
    area = ConvertArea(pool, 64)
    pages = pages_of(list(range(40, 44)))  # flat pages (layer 1's blocks 8..11)
    index = slice(pages[0], pages[0] + 4) if pages == sorted(pages) else torch.tensor(pages)
    area.convert(1, index)
    flat = pool.kv.view(-1, H, N, 2 * D)[pages]  # [4, H, N, 2D]
    want = flat.permute(0, 2, 1, 3).reshape(4 * N, H, 2 * D)
    assert torch.equal(area.tensor[1, 0, : 4 * N], want[..., :D]) and torch.equal(area.tensor[1, 1, : 4 * N], want[..., D:])


def test_a_room_whose_request_was_refused_fails_on_its_decode_at_once(prefill, decode):
    """A router sends the decode the same request: when ours is refused (a 4xx), its decode is told
    at once, whether its transfer info came first or comes later, not after SGLang's 300 s."""
    decode.transfer_info(31, [1, 2])  # the decode was first
    time.sleep(0.1)
    prefill.refuse_room(31, "the prompt is too long")
    status = decode.receive(5)
    assert status[:3] == [b"KV_STATUS", b"31", b"0"] and status[4] == b"the prompt is too long"
    prefill.refuse_room(32, "bad field 'top_p'")  # refused first
    decode.transfer_info(32, [3])
    status = decode.receive(5)
    assert status[:3] == [b"KV_STATUS", b"32", b"0"] and status[4] == b"bad field 'top_p'"
    prefill.refuse_room(33, "refused, then the same room asked for again")
    prefill.expect("r1", 5, bootstrap_room=33)  # a room in use is never refused by a later call
    prefill.refuse_room(33, "too late")
    decode.transfer_info(33, [4, 5])
    wait_for(lambda: prefill.is_ready("r1"))
    eng = Engine(prefill, "r1", 5)
    eng.run(first_token=7)
    eng.free()
    assert decode.receive(5)[:3] == [b"KV_STATUS", b"33", b"4"]
    assert prefill.num_active == 0


def test_the_backend_reports_the_bootstrap_port_the_os_gave():
    """--bootstrap-port 0 binds any free port: the server's banner, /server_info and the rooms it
    checks name that port, not 0."""
    from prefill_server.backends import SGLangBackend
    from prefill_server.config import SGLangConfig

    backend = SGLangBackend(SGLangConfig(bootstrap_port=0, page_size=PS))
    assert backend.bootstrap_port == 0  # before start-up: as configured
    producer = backend.make_producer(KVPool(L, 8, H, N, D), "model", (), "127.0.0.1", 0, 30.0)
    producer.start()
    try:
        assert backend.bootstrap_port == producer.bootstrap_port > 0
    finally:
        producer.stop()

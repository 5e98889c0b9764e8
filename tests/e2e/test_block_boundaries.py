"""Prompt lengths around KV block boundaries never harm the decode, in every mode.

A stock vLLM decode allocates blocks for the whole prompt it is sent and asserts that the prefill
offers as many (``num_decode_blocks <= len(prefill_group)`` in its NixlConnector worker): one short
and its engine core dies for every later request. With the first token from our prefill the decode
is sent prompt + [t1], one token more than we computed, which crosses into a new block exactly when
the prompt is a multiple of the block size. So: lengths 1, 2 and b-1, b, b+1 for multiples b of
the decode's block size, through nixl-compat (against a decode without and with its own prefix
cache, vLLM's default) and connector mode, with --first-token prefill and decode. Every answer must
be vLLM alone's (fp32), the decode must stay healthy after each, and no KV may be left behind.
"""
from __future__ import annotations

import os
import pathlib

import httpx
import pytest

from conftest import DECODE_BLOCK_SIZE, skip_or_fail
from gateway import GatewayThread
from prompts import all_prompts
from test_connector_pipeline import connector_gateway, running_connector_decode, secret_file  # noqa: F401
from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.local_vllm import VllmDecode, vllm_python
from prefill_server.serving.server import build_service

pytestmark = pytest.mark.e2e
MAX_TOKENS = 4
LENGTHS = sorted({1} | {m * DECODE_BLOCK_SIZE + d for m in (1, 2, 4) for d in (-1, 0, 1)})


def prompt_ids(svc, n: int) -> list[int]:
    """The first n tokens of a long real text (greedy continuations of real text are stable)."""
    text = max((p for p in all_prompts() if p.kind == "plain"), key=lambda p: p.approx_tokens).text
    ids = svc.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


def completion(url: str, ids: list[int], model: str | None = None) -> list[int]:
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}
    if model:
        body["model"] = model
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, f"{len(ids)} tokens: {r.status_code} {r.text[:500]}"
    return r.json()["choices"][0]["logprobs"]["tokens"]


def sweep(decode: VllmDecode, gateways: dict[str, GatewayThread]) -> None:
    """Every length through every gateway, against vLLM alone; the gateways are stopped after."""
    try:
        _sweep(decode, gateways)
    finally:
        for gw in gateways.values():
            gw.stop()


def _sweep(decode: VllmDecode, gateways: dict[str, GatewayThread]) -> None:
    model = decode.served_model_name()
    svc = next(iter(gateways.values())).service
    failures = []
    for n in LENGTHS:
        ids = prompt_ids(svc, n)
        alone = completion(decode.url, ids, model)
        for name, gw in gateways.items():
            try:
                ours = completion(gw.url, ids)
            except AssertionError as e:
                ours = str(e)
            try:
                alive = httpx.get(decode.url + "/health", timeout=30).status_code == 200
            except httpx.HTTPError:
                alive = False
            assert alive, f"the decode died on a {n}-token prompt ({name}); its log: {decode.log_path}"
            if ours != alone:
                failures.append((n, name, ours, alone))
    assert failures == [], failures
    for name, gw in gateways.items():
        assert gw.wait_pool_empty() == 0, f"KV blocks left in the prefill pool ({name})"


def compat_gateways(decode: VllmDecode) -> dict[str, GatewayThread]:
    out = {}
    for first in ("prefill", "decode"):
        svc = build_service(EngineConfig(model=decode.model, dtype="float32", kv_cache_gib=0.1),
                            ServerConfig(transfer_mode="nixl-compat", decode_urls=(decode.url,), first_token=first))
        out[f"nixl-compat, first token {first}"] = GatewayThread(svc, decode.url).start()
    return out


def test_nixl_compat_block_boundaries(vllm_decode):
    sweep(vllm_decode, compat_gateways(vllm_decode))


@pytest.fixture(scope="module")
def prefix_caching_decode(decode_model_dir, tmp_path_factory):
    if vllm_python() is None:
        skip_or_fail("no vLLM decode venv with vllm installed at .venv-vllm: run scripts/setup.sh")
    log_dir = os.environ.get("PREFILL_E2E_LOG_DIR")
    log_dir = pathlib.Path(log_dir) if log_dir else tmp_path_factory.mktemp("vllm-prefix")
    with VllmDecode(model=str(decode_model_dir), log_path=log_dir / "vllm-prefix-caching-decode.log",
                    dtype="float32", block_size=DECODE_BLOCK_SIZE, prefix_caching=True) as d:
        d.completion("Warm up.", max_tokens=2)
        yield d


def test_nixl_compat_block_boundaries_decode_prefix_cache(prefix_caching_decode):
    """The sweep's prompts share their heads: the decode finds them in its own cache and reads
    only the blocks it lacks, the LAST ones of the list we offer."""
    sweep(prefix_caching_decode, compat_gateways(prefix_caching_decode))


@pytest.fixture(scope="module")
def connector_decode(decode_model_dir, tmp_path_factory, secret_file):  # noqa: F811
    yield from running_connector_decode(decode_model_dir, tmp_path_factory, secret_file, "boundaries")


def test_connector_block_boundaries(connector_decode, secret_file):  # noqa: F811
    sweep(connector_decode, {f"connector, first token {first}": connector_gateway(
        connector_decode, secret_file, "float32", first_token=first) for first in ("prefill", "decode")})

"""Connector mode's pull fallback end to end: an unmodified vLLM 0.32 decode loads our connector
with ``kv_connector_extra_config.transfer_mode = "pull"``; the prefill computes each prompt into
its pool (chunked past the token budget), leases the blocks, and the decode READs them."""
from __future__ import annotations

import httpx
import pytest

from prompts import all_prompts
from test_connector_pipeline import (connector_gateway, running_connector_decode, secret_file,  # noqa: F401
                                     wait_decode_idle)  # (secret_file: a fixture)
from test_pipeline import ask

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pull_decode(decode_model_dir, tmp_path_factory, secret_file):
    yield from running_connector_decode(decode_model_dir, tmp_path_factory, secret_file, "pull",
                                        transfer_timeout_s=120.0, transfer_mode="pull")


@pytest.fixture(scope="module")
def gateway(pull_decode, secret_file):
    gw = connector_gateway(pull_decode, secret_file, "float32")
    yield gw
    gw.stop()


def test_pull_fallback_token_identical_and_nothing_left(pull_decode, gateway):
    ps = sorted(all_prompts(), key=lambda p: p.approx_tokens)
    picked = [ps[0], next(p for p in ps if p.kind == "chat"), ps[len(ps) // 2], ps[-1]]  # the last > budget
    model = pull_decode.served_model_name()
    producer = gateway.service.worker.engine.producer
    before = producer.stats()
    mismatches = []
    for p in picked:
        if [t for t, _ in ask(gateway.url, p)] != [t for t, _ in ask(pull_decode.url, p, model)]:
            mismatches.append(p.name)
    assert mismatches == [], f"pull pipeline differs from vLLM alone for {mismatches}"
    after = producer.stats()
    assert after.published_total - before.published_total == len(picked)  # leased: really pulled
    assert gateway.wait_pool_empty() == 0 and producer.num_active == 0  # every lease freed by its READ
    assert after.released_total - before.released_total == len(picked)
    assert after.leases_expired_total == before.leases_expired_total
    assert wait_decode_idle(pull_decode) == 0.0


def test_pull_prefill_failure_fails_the_decode_request_cleanly(pull_decode, gateway):
    engine = gateway.service.worker.engine
    run = engine.runner.run

    def failing(chunks):
        raise RuntimeError("injected prefill failure")

    engine.runner.run = failing
    try:
        r = httpx.post(gateway.url + "/v1/completions", json={"prompt": "Fail me, please.", "max_tokens": 4},
                       timeout=120)
    finally:
        engine.runner.run = run
    assert r.status_code >= 500 and "injected prefill failure" in r.text
    assert gateway.wait_pool_empty() == 0 and engine.producer.num_active == 0
    assert wait_decode_idle(pull_decode) == 0.0
    r = httpx.post(gateway.url + "/v1/completions", json={"prompt": "Still serving?", "max_tokens": 4}, timeout=120)
    assert r.status_code == 200

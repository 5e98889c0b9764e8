"""The prefix cache seen from HTTP (transfer mode local, the real model): cached_tokens in the usage,
the metrics, POST /reset_prefix_cache (vLLM's path; the API key when one is set)."""
import pytest
from fastapi.testclient import TestClient

from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.serving.auth import ApiKeys
from prefill_server.serving.http import create_app
from prefill_server.serving.server import build_service


@pytest.fixture(scope="module")
def service():
    svc = build_service(EngineConfig(dtype="float32", num_kv_blocks=64, block_size=16, token_budget=256,
                                     max_queue_wait_s=10.0, lease_ttl_s=30.0, warm_up_tokens=0),
                        ServerConfig(transfer_mode="local"))
    svc.worker.engine.start()
    yield svc
    svc.worker.engine.stop()


def metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_hit_is_reported_counted_and_reset(service):
    head = "You are a helpful assistant. Answer briefly and cite the documents. " * 4
    with TestClient(create_app(service, None, ApiKeys("s3cret"))) as c:
        auth = {"authorization": "Bearer s3cret"}
        first = c.post("/v1/completions", json={"prompt": head + "Question one?", "temperature": 0}, headers=auth)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        second = c.post("/v1/completions", json={"prompt": head + "Another question?", "temperature": 0},
                        headers=auth).json()["usage"]
        assert second["prompt_tokens_details"]["cached_tokens"] >= 48  # the shared head's full blocks
        m = c.get("/metrics").text
        assert metric(m, "prefill_server:prefix_cache_hits_total") == second["prompt_tokens_details"]["cached_tokens"]
        assert metric(m, "prefill_server:prefix_cache_queries_total") == first.json()["usage"]["prompt_tokens"] + \
            second["prompt_tokens"]
        assert metric(m, "prefill_server:prefix_cache_blocks") > 0
        assert c.post("/reset_prefix_cache").status_code == 401
        r = c.post("/reset_prefix_cache", headers=auth)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert metric(c.get("/metrics").text, "prefill_server:prefix_cache_blocks") == 0
        third = c.post("/v1/completions", json={"prompt": head + "Another question?", "temperature": 0},
                       headers=auth).json()["usage"]
        assert third["prompt_tokens_details"]["cached_tokens"] == 0
    assert service.worker.engine.pool.num_used == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_cache_salt_isolates_tenants_and_is_checked_as_vllm_checks_it(service, path):
    """vLLM's ``cache_salt``: a prompt's cached blocks serve only requests sending the same salt."""
    text = "Summarize the quarterly report of the tenant in three short sentences please. " * 4
    body = {"messages": [{"role": "user", "content": text}]} if "chat" in path else {"prompt": text}
    with TestClient(create_app(service, None, None)) as c:
        assert c.post("/reset_prefix_cache").status_code == 200

        def cached(**extra) -> int:
            r = c.post(path, json={**body, "temperature": 0, "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(cache_salt="tenant-a") == 0
        assert cached(cache_salt="tenant-a") >= 48
        assert cached(cache_salt="tenant-b") == 0 and cached() == 0
        assert cached(cache_salt="tenant-b") >= 48 and cached() >= 48
        for bad in ("", "x" * 129, "a/b", "a@b", "a\\b", "a\x00b", 7, ["s"]):
            r = c.post(path, json={**body, "max_tokens": 1, "cache_salt": bad})
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "cache_salt" and "cache_salt" in r.json()["error"]["message"]
        assert cached(cache_salt="x" * 128) == 0  # vLLM's longest
        assert c.get("/health").status_code == 200
    assert service.worker.engine.pool.num_used == 0

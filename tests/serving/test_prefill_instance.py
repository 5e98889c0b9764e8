"""A prefill instance behind a PD router (serving/prefill_instance.py): started without --decode-url,
it answers a request carrying ``kv_transfer_params.do_remote_decode`` with one token, ``usage`` and the
kv_transfer_params a stock vLLM 0.32 prefill returns, its KV leased on a real NIXL side channel.
The request bodies are those vllm-router 0.1.17 sent (captured), vLLM's toy proxy and llm-d's sidecar
send; the live router test runs the real vllm-router binary. The real decode reading the KV is the
e2e test's (tests/e2e/test_pd_routers.py)."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from fake_decode import FakeDecode
from prefill_server.config import EngineConfig, NixlCompatConfig, ServerConfig
from prefill_server.serving.background import BackgroundServer
from prefill_server.serving.http import create_app
from prefill_server.serving.server import bind, build_service

BS = 16
REQUESTS = json.loads((pathlib.Path(__file__).parent / "data" / "pd_router_requests.json").read_text())
PARAM_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
              "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
              "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens"}


@pytest.fixture(scope="module")
def service():
    """A pure prefill instance: transfer mode nixl-compat, no --decode-url, leases of 2 s."""
    svc = build_service(EngineConfig(dtype="float32", num_kv_blocks=64, block_size=BS, token_budget=256,
                                     max_queue_wait_s=30.0, lease_ttl_s=2.0, warm_up_tokens=0),
                        ServerConfig(transfer_mode="nixl-compat", nixl_compat=NixlCompatConfig(decode_model="m")))
    svc.worker.engine.start()
    yield svc
    svc.worker.engine.stop()


@pytest.fixture()
def client(service):
    with TestClient(create_app(service, None)) as c:
        yield c
    assert wait_free(service) == 0, "a lease was never freed"


def used(svc) -> int:
    return svc.worker.engine.pool.num_used


def wait_free(svc, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while used(svc) and time.monotonic() < deadline:
        time.sleep(0.05)
    return used(svc)


def producer(svc):
    return svc.worker.engine.producer


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_a_routers_request_gets_one_token_and_the_params(client, service, name):
    req = REQUESTS[name]
    r = client.post(req["path"], json=req["body"], headers=req["headers"])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "m" == service.info.served_name  # --decode-model names the served model too
    n = body["usage"]["prompt_tokens"]
    # the prefix cache's hit (the bodies share heads): reported alike to the client and the decode
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert body["usage"]["completion_tokens"] == 1 and cached % BS == 0 and 0 <= cached < n
    (choice,) = body["choices"]
    assert choice["finish_reason"] in ("length", "stop")
    assert body["object"] == ("chat.completion" if "chat" in req["path"] else "text_completion")
    p = body["kv_transfer_params"]
    assert set(p) == PARAM_KEYS, set(p) ^ PARAM_KEYS
    assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False and p["transfer_mode"] == "pull"
    assert p["remote_engine_id"] == producer(service).engine_id
    assert p["remote_port"] in producer(service).side_channel_ports and p["remote_host"] == "127.0.0.1"
    assert p["remote_num_tokens"] == n and len(p["remote_block_ids"][0]) == -(-n // BS)
    assert p["remote_prefill_cached_tokens"] == cached
    assert r.headers["x-request-id"] == req["headers"]["x-request-id"]
    assert used(service) == -(-n // BS)  # leased for the decode; the lease (2 s) frees it: see `client`


def test_a_stream_carries_the_params_on_its_last_chunk(client, service):
    body = dict(REQUESTS["vllm_toy_proxy_chat"]["body"], model="m", stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["kv_transfer_params"]["do_remote_prefill"] is True
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 1
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


@pytest.mark.parametrize("params,field", [
    ("yes", "kv_transfer_params"),
    ([True], "kv_transfer_params"),
    ({"do_remote_decode": "true"}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_decode": 1}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_decode": True, "remote_port": "5600"}, "kv_transfer_params.remote_port"),
    ({"do_remote_decode": True, "remote_block_ids": 3}, "kv_transfer_params.remote_block_ids"),
    ({"do_remote_decode": True, "tp_size": True}, "kv_transfer_params.tp_size"),
    ({"do_remote_prefill": True, "remote_engine_id": "x"}, "kv_transfer_params.do_remote_prefill"),
])
def test_malformed_kv_transfer_params_get_400_naming_the_field(client, service, params, field):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "kv_transfer_params": params})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field.split(".")[-1] in r.json()["error"]["message"]
    assert used(service) == 0  # refused before computing anything
    ok = client.post("/v1/completions", json=REQUESTS["vllm_toy_proxy_completion"]["body"])
    assert ok.status_code == 200, ok.text


def test_without_kv_transfer_params_only_a_first_token_is_answered(client, service):
    r = client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]
    assert r.json().get("kv_transfer_params") is None
    assert used(service) == 0
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8})
    assert r.status_code == 400 and "prefill instance" in r.json()["error"]["message"]
    assert "--decode-url" in r.json()["error"]["message"]


def test_routers_read_vllm_series_in_metrics(client, service):
    text = client.get("/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "prefill_server:requests_total"):
        assert f"\n{name}{{" in text, name
    assert 'model_name="m"' in text and f'block_size="{BS}"' in text
    assert 'enable_prefix_caching="True"' in text  # (the engine's default)

    def usage() -> float:
        line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith("vllm:kv_cache_usage_perc"))
        return float(line.rsplit(" ", 1)[1])
    assert wait_free(service) == 0 and usage() == 0.0
    assert client.post("/v1/completions", json=REQUESTS["vllm_toy_proxy_completion"]["body"]).status_code == 200
    assert usage() > 0  # the leased blocks count, as a vLLM prefill's held blocks do


def test_the_vllm_load_series_move_under_load(client, service):
    """Three long prompts at once: while they are computed, routers see them running or waiting."""
    body = dict(REQUESTS["vllm_toy_proxy_completion"]["body"], prompt=list(range(1000, 1000 + 300)))  # 3 x 19 of the 64 blocks
    seen = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    with ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(client.post, "/v1/completions", json=body) for _ in range(3)]
        while not all(f.done() for f in futs):
            for line in client.get("/metrics").text.splitlines():
                name = line.split("{", 1)[0]
                if name in seen:
                    seen[name] = max(seen[name], float(line.rsplit(" ", 1)[1]))
    assert [f.result().status_code for f in futs] == [200] * 3, [f.result().text for f in futs]
    assert seen["vllm:num_requests_running"] >= 1 and sum(seen.values()) >= 2, seen


def test_other_transfer_modes_refuse_a_routers_request(local_service):
    with TestClient(create_app(local_service, None)) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                            "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 400 and "--transfer-mode nixl-compat" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def _router_binary() -> str | None:
    here = pathlib.Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


def _free_port() -> int:
    s = bind("127.0.0.1", 0)
    port = s.getsockname()[1]
    s.close()
    return port


def test_the_real_vllm_router_forwards_our_params_to_its_decode(service, tmp_path):
    """vllm-router 0.1.17 in --vllm-pd-disaggregation mode, this server as its prefill and a
    stand-in decode that records what reaches it: the decode gets exactly our kv_transfer_params."""
    binary = _router_binary()
    if binary is None:
        pytest.skip("vllm-router is not installed (pip install -e .[test])")
    decode = FakeDecode(model="m")
    with BackgroundServer(create_app(service, None)) as prefill, decode as dec:
        port = _free_port()
        log = open(tmp_path / "router.log", "wb")
        proc = subprocess.Popen([binary, "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", dec.url,
                                 "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(_free_port()),
                                 "--prefill-policy", "round_robin"], stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
                time.sleep(0.2)
            r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "The capital of France is",
                                                         "max_tokens": 3, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            got = decode.requests[-1]["kv_transfer_params"]
            assert got["do_remote_prefill"] is True and got["remote_engine_id"] == producer(service).engine_id
            assert got["remote_port"] in producer(service).side_channel_ports
            assert used(service) == len(got["remote_block_ids"][0])  # held for the decode's READ
        finally:
            proc.terminate()
            proc.wait(10)
    assert wait_free(service) == 0  # no decode read it: the lease expired

"""Several decodes behind one gateway (serving/decodes.py), over real sockets: requests spread by
least outstanding requests, a decode that fails its health check gets none until it answers again,
a decode that cannot be reached is marked down and the request goes to another with the same KV,
readiness is degraded while some are down and fails when all are."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import httpx
import pytest

from fake_decode import FakeDecode
from grpc_harness import make_service
from prefill_server.serving.background import BackgroundServer
from prefill_server.serving.decode_client import DecodeClient
from prefill_server.serving.decodes import Decode, DecodeSet
from prefill_server.serving.http import create_app
from prefill_server.serving.server import bind
from test_gateway_robustness import wait_for


def free_port() -> int:
    s = bind("127.0.0.1", 0)
    port = s.getsockname()[1]
    s.close()
    return port


def pool_used(svc) -> int:
    return svc.worker.engine.pool.num_used


@pytest.fixture()
def service():
    svc = make_service(num_blocks=64, max_queue_wait_s=30.0)
    svc.worker.engine.start()
    yield svc
    svc.worker.engine.stop()


def gateway(svc, urls, interval_s=0.2):
    decodes = DecodeSet([Decode(DecodeClient(u, 30.0)) for u in urls], interval_s, svc.metrics)
    return BackgroundServer(create_app(svc, decodes)).start()


def test_requests_spread_over_decodes_by_least_outstanding(service):
    """Concurrent requests: a decode busy with a slow answer gets none of the next ones; idle
    decodes take turns."""
    with FakeDecode(delay_s=1.5) as slow, FakeDecode() as fast:
        gw = gateway(service, [slow.url, fast.url])
        try:
            first = threading.Thread(target=httpx.post, args=(gw.url + "/v1/completions",),
                                     kwargs={"json": {"prompt": "hi"}, "timeout": 30})
            first.start()
            assert wait_for(lambda: len(slow.requests) + len(fast.requests) == 1, 10)
            busy, idle = (slow, fast) if slow.requests else (fast, slow)
            if busy is fast:  # it went to the fast one and is done: make the slow one busy
                first.join()
                first = threading.Thread(target=httpx.post, args=(gw.url + "/v1/completions",),
                                         kwargs={"json": {"prompt": "hi"}, "timeout": 30})
                first.start()
                assert wait_for(lambda: len(slow.requests) == 1, 10)
            n_fast = len(fast.requests)
            for _ in range(4):  # while the slow decode holds one, the fast one (0 outstanding) gets each
                assert httpx.post(gw.url + "/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 200
            assert len(fast.requests) == n_fast + 4 and len(slow.requests) == 1
            first.join()
            for _ in range(4):  # both idle: in turn
                assert httpx.post(gw.url + "/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 200
            assert len(slow.requests) == 3 and len(fast.requests) == n_fast + 6
            text = httpx.get(gw.url + "/metrics").text
            assert f'prefill_server:decode_requests_outstanding{{decode="{slow.url}"}} 0.0' in text
            assert f'prefill_server:decode_up{{decode="{fast.url}"}} 1.0' in text
        finally:
            gw.stop()


def test_a_decode_failing_its_health_check_gets_nothing_until_it_is_back(service):
    with FakeDecode() as a, FakeDecode() as b:
        gw = gateway(service, [a.url, b.url])
        try:
            a.healthy = False
            assert wait_for(lambda: httpx.get(gw.url + "/health").json().get("degraded"), 5)
            ready = httpx.get(gw.url + "/health")
            assert ready.status_code == 200 and a.url in ready.json()["degraded"][0]
            for _ in range(4):
                assert httpx.post(gw.url + "/v1/completions", json={"prompt": "hi"}).status_code == 200
            assert len(a.requests) == 0 and len(b.requests) == 4
            b.healthy = False  # none up: readiness fails, requests are refused before any prefill
            assert wait_for(lambda: httpx.get(gw.url + "/health").status_code == 503, 5)
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 503 and a.url in r.json()["error"]["message"] \
                and b.url in r.json()["error"]["message"]
            a.healthy = True
            assert wait_for(lambda: httpx.get(gw.url + "/health").status_code == 200, 5)
            assert httpx.post(gw.url + "/v1/completions", json={"prompt": "hi"}).status_code == 200
            assert len(a.requests) == 1
        finally:
            gw.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_an_unreachable_decode_is_skipped_and_the_request_goes_to_another(service, stream):
    dead = f"http://127.0.0.1:{free_port()}"
    with FakeDecode() as live:
        gw = gateway(service, [dead, live.url], interval_s=30)  # (the checks would not notice in time)
        try:
            for _ in range(3):
                r = httpx.post(gw.url + "/v1/completions", json={"prompt": "hi", "stream": stream})
                assert r.status_code == 200 and "[DONE]" in r.text if stream else r.status_code == 200
            assert len(live.requests) == 3
            ready = httpx.get(gw.url + "/health").json()
            assert ready["status"] == "ok" and dead in ready["degraded"][0]
        finally:
            gw.stop()


def test_every_decode_unreachable_gives_502_naming_them(service):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    gw = gateway(service, dead, interval_s=30)
    try:
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 502
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and all(u in r.json()["error"]["message"] for u in dead)
    finally:
        gw.stop()
    assert pool_used(service) == 0


def test_decode_set_picks_within_a_group_and_counts_each_request_once():
    async def run():
        clients = [DecodeClient(f"http://d{i}:1") for i in range(3)]
        s = DecodeSet([Decode(clients[0], "g1"), Decode(clients[1], "g1"), Decode(clients[2], "g2")])
        a = s.assign("g2")
        assert a.decode.url == "http://d2:1" and a.decode.outstanding == 1
        a.end()
        a.end()
        assert a.decode.outstanding == 0
        a = s.assign("g1")
        b = s.reassign(a, "refused", [a.decode])
        assert b is not None and b.decode.group == "g1" and b.decode is not a.decode and not a.decode.up
        assert s.reassign(b, "refused", [a.decode, b.decode]) is None  # g2's decode takes other KV
        assert [d.outstanding for d in s.decodes] == [0, 0, 0]
        for c in clients:
            await c.close()
    asyncio.run(run())


class FlakyHealth:
    """A decode client stand-in whose health checks answer from a script of results (None = healthy)."""

    base_url = "http://flaky:1"

    def __init__(self, answers):
        self.answers, self.calls = list(answers), 0

    async def health(self, timeout_s: float = 5.0):
        self.calls += 1
        return self.answers.pop(0) if self.answers else None

    async def close(self):
        pass


def test_one_failed_health_check_does_not_mark_an_up_decode_down_but_two_do():
    async def run():
        flaky = FlakyHealth(["ReadTimeout", None, "ConnectError", "ConnectError"])
        s = DecodeSet([Decode(flaky)], interval_s=0.05)
        s.start()
        try:
            for _ in range(100):
                if flaky.calls >= 2:
                    break
                await asyncio.sleep(0.01)
            assert s.decodes[0].up  # the timeout, then an answer at once: still up
            for _ in range(100):
                if not s.decodes[0].up:
                    break
                await asyncio.sleep(0.01)
            assert not s.decodes[0].up and s.decodes[0].reason == "ConnectError" and flaky.calls == 4
        finally:
            await s.stop()
    asyncio.run(run())


@pytest.fixture()
def smollm2_short_leases():
    """The embedded SmolLM2 (fp32, blocks of 16, the prefix cache on: the default) whose leases
    expire in 1 s: a stand-in decode never reads them."""
    from prefill_server.config import EngineConfig, ServerConfig
    from prefill_server.serving.server import build_service

    svc = build_service(EngineConfig(dtype="float32", num_kv_blocks=64, block_size=16, token_budget=256,
                                     lease_ttl_s=1.0), ServerConfig(transfer_mode="local"))
    svc.worker.engine.start()
    yield svc
    assert wait_for(lambda: svc.worker.engine.pool.num_used == 0, 10)
    svc.worker.engine.stop()


def test_answers_relayed_from_the_decode_say_the_prefills_cached_tokens(smollm2_short_leases):
    """usage.prompt_tokens_details.cached_tokens is the prefill's prefix-cache hit (whole blocks,
    never the last token's), on the decode's answer relayed as it came and on one put together
    with the first token from the prefill; without a prefix cache the decode's usage is untouched."""
    svc = smollm2_short_leases
    assert svc.info.prefix_cache
    prompt = list(range(1000, 1000 + 16 * 3 + 5))  # 53 tokens: 3 whole blocks

    def cached(gw, body: dict):
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, **body})
        assert r.status_code == 200, r.text
        return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")

    with FakeDecode() as d:
        gw = gateway(svc, [d.url])
        try:
            assert cached(gw, {"temperature": 0}) == 0  # cold; t1 from the prefill (a merged answer)
            assert cached(gw, {"temperature": 0}) == 48
            assert cached(gw, {"temperature": 0.7}) == 48  # sampled at the decode: its answer, relayed
            svc.info = dataclasses.replace(svc.info, prefix_cache=False)
            assert cached(gw, {"temperature": 0.7}) is None  # the decode's usage as it came
        finally:
            svc.info = dataclasses.replace(svc.info, prefix_cache=True)
            gw.stop()

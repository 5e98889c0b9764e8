"""A release the pool sends to the worker holding a request (``RayPool._release``): never while that
worker is silent (Serve would hold one of its routing tasks on it until the call timed out, delaying
every other request's routing), sent once it answers again, dropped once it is gone."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from prefill_server.cluster import pool as pool_mod, routers  # noqa: E402
from prefill_server.cluster.pool import RayPool  # noqa: E402


class Router:  # what the pool reads of its PrefillRouter
    def __init__(self):
        self.running, self.silent = {"w1", "w2"}, set()

    def running_ids(self) -> set[str]:
        return set(self.running)

    def answering(self, worker: str) -> bool:
        return worker in self.running and worker not in self.silent


def make_pool():
    sent: list[dict] = []

    async def remote(body):
        sent.append(body)
        return True

    p = RayPool.__new__(RayPool)
    p._handle = SimpleNamespace(release=SimpleNamespace(remote=remote))
    return p, sent


@pytest.fixture
def router():
    r = Router()
    routers.LIVE.append(r)
    yield r
    routers.LIVE.remove(r)


def test_a_release_goes_at_once_to_an_answering_worker(router):
    p, sent = make_pool()
    asyncio.run(p._release("pf-1", "w1"))
    assert sent == [{"request_id": "pf-1", "_hints": {"replica": "w1"}}]


def test_a_release_waits_while_its_worker_is_silent_then_goes(router):
    p, sent = make_pool()
    router.silent.add("w1")

    async def scenario():
        task = asyncio.ensure_future(p._release("pf-2", "w1"))
        await asyncio.sleep(1.2)
        assert not sent and not task.done()  # (nothing in Serve's queue meanwhile)
        router.silent.discard("w1")  # a slow worker that answers again still gets its release
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert [b["request_id"] for b in sent] == ["pf-2"]


def test_a_release_for_a_worker_gone_while_silent_is_dropped(router, monkeypatch):
    p, sent = make_pool()
    router.silent.add("w2")

    async def scenario():
        task = asyncio.ensure_future(p._release("pf-3", "w2"))
        await asyncio.sleep(0.7)
        router.running.discard("w2")  # replaced: its leases went with it
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert sent == []
    monkeypatch.setattr(pool_mod, "RELEASE_WAIT_S", 0.3)  # silent for good, never replaced: given up
    router.silent.add("w1")
    asyncio.run(asyncio.wait_for(p._release("pf-4", "w1"), 5))
    assert sent == []


def test_keep_sends_each_worker_its_leases_in_one_call(router):
    """The gateway's lease keeper (``RayPool.keep``): one call per worker holding some of the
    requests; requests of a gone worker (its leases went with it) or unknown ones are passed over."""
    sent: list[dict] = []

    async def remote(body):
        sent.append(body)

    p = RayPool.__new__(RayPool)
    p._handle = SimpleNamespace(keep=SimpleNamespace(remote=remote))
    p._leases = OrderedDict([("a", "w1"), ("b", "w2"), ("c", "w1"), ("d", "gone")])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    p._loop = loop
    try:
        p.keep(["a", "b", "c", "d", "unknown"], 30.0)
        deadline = time.monotonic() + 5
        while len(sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    assert sorted(sent, key=lambda b: b["_hints"]["replica"]) == [
        {"request_ids": ["a", "c"], "ttl_s": 30.0, "_hints": {"replica": "w1"}},
        {"request_ids": ["b"], "ttl_s": 30.0, "_hints": {"replica": "w2"}}]

"""Placement and draining of the pool's workers on a local Ray with fake GPUs (``ray.init(num_gpus=4)``):
one worker per GPU, each holding its GPU in its own placement group; a fifth stays pending; a
worker that crashes comes back on a free GPU; a rolling update (to fewer workers) lets each old
worker finish the requests it holds."""
from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(900)

from kv_transfer.base import Route  # noqa: E402
from prefill_server.cluster.pool import build_ray_pool  # noqa: E402
from prefill_server.config import EngineConfig, PoolConfig, ServerConfig  # noqa: E402
from prefill_server.engine.types import PrefillRequest  # noqa: E402


def wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def pool():
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, logging_level="warning")
    scfg = ServerConfig(transfer_mode="local", drain_timeout_s=90.0,
                        pool=PoolConfig(workers=5, worker_gpus=1.0, worker_cpus=1.0))
    ecfg = EngineConfig(device="cpu", dtype="float32", kv_cache_gib=0.1, warm_up_tokens=0, cpu_threads=1)
    p = build_ray_pool(ecfg, scfg, ())
    p.start()
    try:
        yield p
    finally:
        p.stop()
        ray.shutdown()


def running(p) -> dict[str, dict]:
    return {w["worker"]: w["stats"] for w in p.workers() if w["stats"]}


def test_one_worker_per_gpu_and_a_fifth_waits(pool):
    assert wait_for(lambda: len(running(pool)) == 4, 300), pool.pool_status()
    gpus = sorted(tuple(s["gpu_ids"]) for s in running(pool).values())
    assert gpus == [("0",), ("1",), ("2",), ("3",)]
    states = pool.pool_status()["replica_states"]
    assert states.get("RUNNING") == 4 and sum(states.values()) == 5, states  # the fifth: no GPU for it
    pgs = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]
    assert sum(b.get("GPU", 0) for pg in pgs for b in pg["bundles"].values()) == 4  # each holds its GPU


def test_a_crashed_worker_comes_back_on_a_free_gpu(pool):
    assert wait_for(lambda: len(running(pool)) == 4, 300)
    victim = next(iter(running(pool).values()))
    os.kill(victim["pid"], signal.SIGKILL)
    assert wait_for(lambda: len(running(pool)) == 4 and victim["pid"] not in
                    {s["pid"] for s in running(pool).values()}, 240), pool.pool_status()
    assert sorted(tuple(s["gpu_ids"]) for s in running(pool).values()) == [("0",), ("1",), ("2",), ("3",)]
    r = pool.submit(PrefillRequest("after-crash", tuple(range(100, 164)))).result(120)
    assert r.num_prompt_tokens == 64
    pool.release("after-crash")


def test_a_rolling_update_drains_what_the_old_workers_hold(pool):
    assert wait_for(lambda: len(running(pool)) == 4, 300)
    futs = [pool.submit(PrefillRequest(f"held-{i}", tuple(1000 + (i * 31 + j) % 5000 for j in range(400)),
                                       route=Route.LEASE)) for i in range(4)]
    time.sleep(2)
    assert not all(f.done() for f in futs), [f.exception() for f in futs if f.done()]
    pool.set_workers(1)  # a rolling update to one worker: every old one drains
    results = [f.result(300) for f in futs]  # none fails
    assert [r.num_prompt_tokens for r in results] == [400] * 4
    for i in range(4):
        pool.release(f"held-{i}")
    assert wait_for(lambda: pool.pool_status()["replica_states"] == {"RUNNING": 1}, 120), pool.pool_status()

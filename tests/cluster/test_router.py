"""The pool's request router (cluster/router.py) on stand-ins for Serve's running replicas: each
policy picks as documented, outstanding tokens are the larger of what the router sent and what the
worker reported, a release goes to the worker named, a retry avoids the worker that died, and a
worker that stopped reporting is tried last."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from prefill_server.cluster import routers  # noqa: E402
from prefill_server.cluster.router import SILENT_S, PrefillRouter, prefix_hashes  # noqa: E402


@dataclass
class Replica:  # what the router reads of Serve's RunningReplica
    name: str
    routing_stats: dict = field(default_factory=dict)
    node_id: str = "node"

    @property
    def replica_id(self):
        return SimpleNamespace(unique_id=self.name)


def make_router(policy: str, slack: int = 1000) -> PrefillRouter:
    r = PrefillRouter.__new__(PrefillRouter)  # (Serve's own constructor needs a running controller)
    r._replicas = {}
    r.initialize_state(policy=policy, prefix_slack_tokens=slack)
    return r


def pending(n_tokens: int = 0, method: str = "run", **hints):
    return SimpleNamespace(args=[{"_hints": {"num_tokens": n_tokens, **hints}}], kwargs={},
                           metadata=SimpleNamespace(call_method=method, internal_request_id=f"i{id(hints)}{n_tokens}"),
                           routing_context=SimpleNamespace(should_backoff=False))


def choose(router, replicas, req):
    ranks = asyncio.run(router.choose_replicas(replicas, req))
    return ranks[0][0].name


def route(router, replicas, req) -> str:
    name = choose(router, replicas, req)
    router.on_request_routed(req, SimpleNamespace(unique_id=name), None)
    return name


def test_least_tokens_weighs_prompts_by_their_tokens():
    router = make_router("least-tokens")
    a, b = Replica("a"), Replica("b")
    first = route(router, [a, b], pending(100_000))
    other = "b" if first == "a" else "a"
    for _ in range(20):  # a hundred thousand tokens outweigh twenty short requests
        assert route(router, [a, b], pending(100)) == other
    assert router in routers.LIVE


def test_reported_load_counts_when_larger_than_what_was_sent():
    router = make_router("least-tokens")
    a, b = Replica("a", {"pending_tokens": 50_000}), Replica("b", {"pending_tokens": 10})
    assert {route(router, [a, b], pending(10)) for _ in range(5)} == {"b"}


def test_completed_requests_stop_counting_and_ties_take_turns():
    router = make_router("least-tokens")
    a, b = Replica("a"), Replica("b")
    req = pending(5000)
    first = route(router, [a, b], req)
    router.on_request_completed(SimpleNamespace(unique_id=first), req.metadata.internal_request_id)
    assert router.outstanding_tokens(a) == router.outstanding_tokens(b) == 0
    picks = [route(router, [a, b], pending(1)) for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"] and picks[0] != first


def test_a_turn_is_taken_when_a_request_is_routed_not_when_serve_asks():
    """Serve asks again when a queue probe times out: asking twice must not skip a worker."""
    router = make_router("least-tokens")
    a, b = Replica("a"), Replica("b")
    picks = []
    for _ in range(6):
        choose(router, [a, b], pending(1))  # asked, then not routed
        picks.append(route(router, [a, b], pending(1)))
    assert sorted(picks) == ["a"] * 3 + ["b"] * 3


def test_a_report_older_than_a_finished_request_does_not_count_it():
    router = make_router("least-tokens")
    a, b = Replica("a"), Replica("b")
    req = pending(5000)
    first = route(router, [a, b], req)
    busy = a if first == "a" else b
    busy.routing_stats = {"pending_tokens": 5000, "reported_at": time.time() - 0.5}  # taken while it ran
    router.on_request_completed(SimpleNamespace(unique_id=first), req.metadata.internal_request_id)
    assert router.outstanding_tokens(busy) == 0
    busy.routing_stats = {"pending_tokens": 7000, "reported_at": time.time() - 0.5}  # others' 2000 remain
    assert router.outstanding_tokens(busy) == 2000
    busy.routing_stats = {"pending_tokens": 5000, "reported_at": time.time() + 1}  # newer: counts whole
    assert router.outstanding_tokens(busy) == 5000


def test_p2c_never_picks_the_busiest_of_three():
    router = make_router("p2c")
    reps = [Replica("a", {"pending_tokens": 0}), Replica("b", {"pending_tokens": 10}),
            Replica("c", {"pending_tokens": 10_000})]
    assert "c" not in {choose(router, reps, pending(1)) for _ in range(50)}


SALT = b"s" * 16


def test_prefix_affinity_capped_by_load():
    router = make_router("prefix", slack=2500)
    a, b = Replica("a"), Replica("b")
    doc = list(range(64 * 16))
    hashes = prefix_hashes(doc + [7, 8, 9], 16, SALT)
    assert len(hashes) == 64 and hashes == prefix_hashes(doc, 16, SALT)  # full blocks only
    home = route(router, [a, b], pending(len(doc), prefix=hashes))
    for q in range(2):  # the same document, other questions: the same worker
        assert route(router, [a, b], pending(len(doc) + 3, prefix=prefix_hashes(doc + [q] * 3, 16, SALT))) == home
    # the holder now has ~3K outstanding, more than the slack over the idle one: load wins
    other = "b" if home == "a" else "a"
    assert route(router, [a, b], pending(len(doc), prefix=hashes)) == other


def test_a_cache_reset_makes_the_router_forget_who_held_what():
    router = make_router("prefix", slack=10**9)
    a, b = Replica("a", {"pending_tokens": 0}), Replica("b", {"pending_tokens": 0})
    hashes = prefix_hashes(list(range(8 * 16)), 16, SALT)
    home = route(router, [a, b], pending(10, prefix=hashes))
    assert router._holder([a, b], hashes).replica_id.unique_id == home
    router.forget_prefixes()
    assert router._holder([a, b], hashes) is None


@pytest.mark.parametrize("quantization,kv_cache_dtype", [("none", "auto"), ("fp8", "auto"), ("none", "fp8")])
def test_prefix_hints_name_blocks_as_the_workers_prefix_cache_does(quantization, kv_cache_dtype):
    """The pool's hints for a prompt are the hashes a worker's cache gives its blocks: the same
    chain under the same salt of model, dtype, quantization, KV page format and block size (another
    salt names other blocks)."""
    from prefill_server.backends import backend_for
    from prefill_server.cluster.pool import build_ray_pool
    from prefill_server.config import EngineConfig, PoolConfig, ServerConfig
    from prefill_server.engine.prefix_cache import block_hashes
    from prefill_server.engine.worker import build_local_worker

    ecfg = EngineConfig(dtype="float32", num_kv_blocks=16, block_size=16, prefix_cache=True,
                        quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    scfg = ServerConfig(transfer_mode="local")
    pool = build_ray_pool(ecfg, dataclasses.replace(scfg, pool=PoolConfig(workers=2)), ())
    engine_pool = build_local_worker(ecfg, backend_for(scfg), (), side_channel_host="127.0.0.1",
                                     side_channel_port=0).engine.pool
    ids = list(range(100, 100 + 5 * 16 + 3))
    assert pool.cache_salt == engine_pool.cache_salt
    assert prefix_hashes(ids, 16, pool.cache_salt) == [h.hex() for h in block_hashes(ids, 16, engine_pool.cache_salt)]
    assert prefix_hashes(ids, 16, SALT) != prefix_hashes(ids, 16, pool.cache_salt)


def test_round_robin_takes_turns_whatever_the_load():
    router = make_router("round-robin")
    reps = [Replica("a", {"pending_tokens": 10**6}), Replica("b"), Replica("c")]
    assert [route(router, reps, pending(1)) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_a_named_replica_and_an_avoided_one():
    router = make_router("least-tokens")
    a, b = Replica("a"), Replica("b", {"pending_tokens": 10**6})
    assert choose(router, [a, b], pending(method="release", replica="b")) == "b"
    assert choose(router, [a], pending(method="release", replica="b")) == "a"  # gone: any answers "not held"
    assert choose(router, [a, b], pending(1, avoid=["a"])) == "b"
    assert choose(router, [a], pending(1, avoid=["a"])) == "a"  # all avoided: any


@pytest.mark.parametrize("policy", ["least-tokens", "p2c", "prefix", "round-robin"])
def test_a_worker_whose_reports_stopped_is_tried_last(policy):
    """A hung worker's last report grows old (Serve asks every second): it looks idle, but a request
    sent there would wait until its health check removes it, so every answering worker comes first."""
    router = make_router(policy)
    now = time.time()
    hung = Replica("a", {"pending_tokens": 0, "reported_at": now - SILENT_S - 1})
    busy = Replica("b", {"pending_tokens": 10**6, "reported_at": now})
    fresh = Replica("c")  # no report yet: a worker just started
    for _ in range(4):
        ranks = asyncio.run(router.choose_replicas([hung, busy, fresh], pending(1)))
        assert [r.name for r in ranks[-1]] == ["a"] and "a" not in {r.name for rank in ranks[:-1] for r in rank}
        router.on_request_routed(pending(1), SimpleNamespace(unique_id=ranks[0][0].name), None)
    router._replicas = {r.name: r for r in (hung, busy, fresh)}
    assert {w["worker"]: w["answering"] for w in router.workers()} == {"a": False, "b": True, "c": True}
    assert [router.answering(n) for n in ("a", "b", "c", "gone")] == [False, True, True, False]
    only = asyncio.run(router.choose_replicas([hung], pending(1)))
    assert [[r.name for r in rank] for rank in only] == [["a"]]  # none answers: still tried


def test_the_router_says_where_serve_sent_a_request():
    """A retry must not land where the first attempt may still hold the request's id (a worker that
    got it but did not say "accepted" in time): the router remembers where each id was routed."""
    router = make_router("least-tokens")
    a, b = Replica("a"), Replica("b")
    req = pending(10, request_id="pf-1")
    assert router.routed_to("pf-1") is None
    name = route(router, [a, b], req)
    assert router.routed_to("pf-1") == name
    other = "b" if name == "a" else "a"
    assert choose(router, [a, b], pending(10, request_id="pf-1", avoid=[name])) == other


def serve_routing_loop(router: PrefillRouter, replicas: list[Replica]) -> PrefillRouter:
    """What Serve's own retry loop (``_choose_replicas_with_backoff``) reads of a router it built."""
    router._replicas = {r.name: r for r in replicas}
    router._replicas_list = list(replicas)
    router.num_routing_tasks_in_backoff = 0
    router.num_routing_tasks_in_backoff_gauge = SimpleNamespace(set=lambda _v: None)
    router.initial_backoff_s, router.backoff_multiplier, router.max_backoff_s = 0.025, 2.0, 0.5
    return router


@pytest.mark.parametrize("hints", [{"replica": "gone"}, {"replica": "a"}, {"avoid": ["a", "b"]}, {}])
def test_serves_routing_loop_gets_a_replica_or_backs_off(hints):
    """Serve asks ``choose_replicas`` again at once, awaiting nothing, until it answers a replica or
    sets ``should_backoff``: an empty answer (a release for a worker that had just died) spun the
    gateway's routing loop for good, so no request was routed and no new worker was seen. Driven
    through Serve's own loop, in a thread, so a spin fails the test instead of hanging it."""
    from ray.serve.request_router import PendingRequest

    router = serve_routing_loop(make_router("least-tokens"), [Replica("a"), Replica("b")])
    got: list[list[str]] = []
    backs_off: list[bool] = []  # were no replica to answer, Serve would sleep before asking again

    async def first_candidates():
        req = PendingRequest(args=[{"_hints": {"num_tokens": 1, **hints}}], kwargs={},
                             metadata=SimpleNamespace(call_method="release", internal_request_id="r1"))
        gen = router._choose_replicas_with_backoff(req)
        got.append([r.name for r in await gen.__anext__()])
        await gen.aclose()
        backs_off.append(req.routing_context.should_backoff)

    t = threading.Thread(target=asyncio.run, args=(first_candidates(),), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "Serve's routing loop spins on this router's answer"
    assert got and got[0] and (hints.get("replica") != "a" or got[0] == ["a"]), got
    assert backs_off == [True]

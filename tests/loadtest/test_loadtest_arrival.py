"""Arrival processes: Poisson's mean rate and gaps, bursts, constant spacing; fixed concurrency never
exceeded; open-loop caps; trace timestamps honoured."""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics

import pytest
from fake_openai import req

from loadtest import arrival, runner, workloads
from loadtest.client import Target
from loadtest.text import TextSource


def test_poisson_mean_rate_and_exponential_gaps():
    xs = list(itertools.islice(arrival.poisson(5.0, random.Random(1)), 20001))
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    assert abs(len(gaps) / xs[-1] - 5.0) / 5.0 < 0.03
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert abs(cv - 1.0) < 0.05  # exponential: std == mean
    again = list(itertools.islice(arrival.offsets("poisson", rate=5.0, seed=9), 50))
    assert again == list(itertools.islice(arrival.offsets("poisson", rate=5.0, seed=9), 50))
    assert again != list(itertools.islice(arrival.offsets("poisson", rate=5.0, seed=10), 50))


def test_bursts_and_constant():
    assert list(itertools.islice(arrival.burst(3, 2.0), 7)) == [0, 0, 0, 2.0, 2.0, 2.0, 4.0]
    assert list(itertools.islice(arrival.constant(4.0), 4)) == [0, 0.25, 0.5, 0.75]
    with pytest.raises(ValueError):
        next(arrival.offsets("poisson", rate=0))
    with pytest.raises(ValueError):
        arrival.offsets("nope")


def _target(fake, **kw) -> Target:
    return Target(label="fake", url=fake.url, max_tokens=kw.pop("max_tokens", 4), **kw)


def test_fixed_concurrency_is_never_exceeded(fake):
    reqs = [req(i, "[[itl=0.01]]") for i in range(24)]
    cfg = runner.RunConfig(arrival="concurrency", concurrency=3, count=24, progress=False)
    run = asyncio.run(runner.run(_target(fake, max_tokens=5), cfg, reqs))
    assert run["summary"]["ok"] == 24
    assert fake.max_in_flight <= 3 and run["summary"]["max_in_flight"] == 3


def test_open_loop_max_concurrency_caps_in_flight(fake):
    reqs = [req(i, "[[itl=0.01]]") for i in range(20)]
    cfg = runner.RunConfig(arrival="constant", rate=500.0, max_concurrency=2, count=20, progress=False)
    run = asyncio.run(runner.run(_target(fake, max_tokens=5), cfg, reqs))
    assert run["summary"]["ok"] == 20 and fake.max_in_flight <= 2
    # planned every 2 ms, ~50 ms each two at a time: the cap shows as send lag (~0.45 s for the last one)
    assert run["summary"]["send_lag_s"]["max"] > 0.2


def test_bursts_reach_the_server_together(fake):
    reqs = [req(i) for i in range(9)]
    cfg = runner.RunConfig(arrival="burst", burst_size=3, burst_interval=0.6, count=9, progress=False)
    run = asyncio.run(runner.run(_target(fake), cfg, reqs))
    assert [r["scheduled_s"] for r in run["records"]] == pytest.approx([0.0] * 3 + [0.6] * 3 + [1.2] * 3)
    sent = [r["sent_s"] for r in run["records"]]
    for k in range(3):  # tolerances for a busy 2-core box
        group = sent[3 * k:3 * k + 3]
        assert max(group) - min(group) < 0.15
        assert 0.6 * k - 0.01 <= min(group) < 0.6 * k + 0.3


def test_poisson_run_honours_the_rate_and_duration(fake):
    reqs = (req(i) for i in itertools.count())
    cfg = runner.RunConfig(arrival="poisson", rate=40.0, duration_s=1.5, seed=4, progress=False)
    run = asyncio.run(runner.run(_target(fake), cfg, reqs))
    n = run["summary"]["requests"]
    expected = len([t for t in itertools.islice(arrival.offsets("poisson", rate=40.0, seed=4), 500) if t < 1.5])
    assert n == expected  # the same seed: the same arrivals, cut at the duration
    assert max(r["scheduled_s"] for r in run["records"]) < 1.5  # none planned after the duration
    assert all(r["sent_s"] >= r["scheduled_s"] - 0.01 for r in run["records"])  # (a busy box may send late)


def test_trace_replay_honours_timestamps_with_a_speedup(fake, tmp_path):
    f = tmp_path / "trace.jsonl"
    stamps = [50.0, 50.5, 51.0, 52.0, 52.25, 54.0]
    f.write_text("\n".join(json.dumps({"timestamp": t, "prompt_tokens": 20, "output_tokens": 2}) for t in stamps))
    params = workloads.WorkloadParams(trace=str(f), trace_speedup=2.0)
    reqs = workloads.make("trace", params, TextSource("words"), 0)
    cfg = runner.RunConfig(arrival="trace", count=len(stamps), progress=False)
    run = asyncio.run(runner.run(_target(fake), cfg, reqs))
    want = [(t - stamps[0]) / 2.0 for t in stamps]  # 0 .. 2 s
    assert [r["scheduled_s"] for r in run["records"]] == pytest.approx(want)  # the plan: exact
    got = [r["sent_s"] for r in run["records"]]  # the deed: never early, late only by a busy box's jitter
    assert all(w - 0.01 <= g < w + 0.3 for g, w in zip(got, want)), (got, want)
    arrived = [t - fake.arrivals[0] for t in fake.arrivals]
    assert all(abs(g - w) < 0.3 for g, w in zip(arrived, want)), (arrived, want)
    assert [r["output_tokens"] for r in run["records"]] == [2] * len(stamps)

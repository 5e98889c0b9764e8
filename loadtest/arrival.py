"""When requests are sent: send-time offsets (seconds from the run's start) of the open-loop arrival
processes; fixed concurrency (closed loop) and trace replay are the runner's (``runner.py``).

- ``poisson``: exponential gaps of mean 1/rate (the usual model of independent users);
- ``constant``: one request every 1/rate seconds;
- ``burst``: ``burst_size`` requests at once every ``burst_interval`` seconds (mean rate
  burst_size / burst_interval);
- ``concurrency``: closed loop, ``concurrency`` requests in flight, the next sent when one ends;
- ``trace``: each request's own timestamp (the trace workload's).
"""
from __future__ import annotations

import itertools
import random
from typing import Iterator

ARRIVALS = ("poisson", "constant", "burst", "concurrency", "trace")


def poisson(rate: float, rng: random.Random) -> Iterator[float]:
    if rate <= 0:
        raise ValueError("a Poisson arrival needs --rate > 0")
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


def constant(rate: float) -> Iterator[float]:
    if rate <= 0:
        raise ValueError("a constant arrival needs --rate > 0")
    for i in itertools.count():
        yield i / rate


def burst(size: int, interval: float) -> Iterator[float]:
    if size < 1 or interval <= 0:
        raise ValueError("a burst arrival needs --burst-size >= 1 and --burst-interval > 0")
    for k in itertools.count():
        for _ in range(size):
            yield k * interval


def offsets(kind: str, *, rate: float | None = None, seed: int = 0, burst_size: int = 1,
            burst_interval: float = 1.0) -> Iterator[float] | None:
    """The send offsets of an open-loop arrival; None for ``concurrency`` and ``trace``."""
    if kind == "poisson":
        return poisson(rate or 0.0, random.Random(f"arrival:{seed}"))
    if kind == "constant":
        return constant(rate or 0.0)
    if kind == "burst":
        return burst(burst_size, burst_interval)
    if kind in ("concurrency", "trace"):
        return None
    raise ValueError(f"unknown arrival {kind!r}; choose from {', '.join(ARRIVALS)}")

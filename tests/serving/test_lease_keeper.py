"""The gateway's lease keeper (serving/lease_keeper.py): one ``keep`` per round for every request
held, none once dropped, and a round that fails does not stop the next."""
from __future__ import annotations

import asyncio

from prefill_server.serving.lease_keeper import LeaseKeeper


def test_what_is_held_is_kept_every_third_of_the_ttl_until_dropped():
    calls: list[list[str]] = []
    marks: dict[str, int] = {}

    async def main() -> LeaseKeeper:
        k = LeaseKeeper(calls.append, ttl_s=0.3)  # a round every 0.1 s
        k.hold("b")
        k.hold("a")
        await asyncio.sleep(0.35)
        k.drop("a")
        marks["a dropped"] = len(calls)
        await asyncio.sleep(0.35)
        k.drop("b")
        marks["b dropped"] = len(calls)
        await asyncio.sleep(0.35)
        return k

    k = asyncio.run(main())
    assert abs(k.interval_s - 0.1) < 1e-9
    assert marks["a dropped"] >= 2 and all(c == ["a", "b"] for c in calls[:marks["a dropped"]])
    after_a = calls[marks["a dropped"]:marks["b dropped"]]
    assert after_a and all(c == ["b"] for c in after_a)
    assert len(calls) == marks["b dropped"], "kept after it was dropped"
    assert k.held == frozenset() and k._task is None  # (the round loop ends with nothing held)


def test_a_failing_round_is_retried_and_a_later_hold_starts_again():
    calls: list[list[str]] = []

    def keep(ids: list[str]) -> None:
        calls.append(ids)
        if len(calls) == 1:
            raise RuntimeError("worker busy")

    async def main() -> None:
        k = LeaseKeeper(keep, ttl_s=0.15)
        k.hold("x")
        await asyncio.sleep(0.18)
        k.drop("x")
        await asyncio.sleep(0.1)
        assert k._task is None
        k.hold("y")
        await asyncio.sleep(0.08)
        k.drop("y")
        await asyncio.sleep(0.06)

    asyncio.run(main())
    assert calls[:2] == [["x"], ["x"]] and calls[-1] == ["y"]

"""A run's live counters and the progress bar drawn from them on stderr.

On a terminal the bar is redrawn in place twice a second; into a file or a CI log it is one line
every ``log_every_s`` (so a long soak leaves a readable log, not megabytes of carriage returns).
The bar's fill is the larger of requests done / ``count`` and time spent / ``duration``: a run
ends at whichever bound comes first.
"""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from loadtest import stats

BAR_WIDTH = 24
RECENT = 200  # the TTFT shown is the p50 of the last RECENT successful requests: how it goes now


@dataclass
class Counters:
    sent: int = 0
    done: int = 0
    ok: int = 0
    failed: int = 0  # ended with an error (client aborts are neither ok nor failed)
    in_flight: int = 0
    max_in_flight: int = 0
    recent_ttfts: list[float] = field(default_factory=list)

    def started(self) -> None:
        self.sent += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def ended(self, status: str | None, ttft_s: float | None, was_sent: bool) -> None:
        self.in_flight -= 1 if was_sent else 0
        self.done += 1
        if status == "ok":
            self.ok += 1
            if ttft_s is not None:
                self.recent_ttfts = self.recent_ttfts[-(RECENT - 1):] + [ttft_s]
        elif status != "aborted":
            self.failed += 1


@dataclass
class Progress:
    counters: Counters
    count: int | None
    duration_s: float | None
    t0: float  # time.perf_counter() at the run's start
    out: TextIO = sys.stderr
    log_every_s: float = 10.0

    def fraction(self) -> float | None:
        parts = []
        if self.count:
            parts.append(self.counters.done / self.count)
        if self.duration_s:
            parts.append((time.perf_counter() - self.t0) / self.duration_s)
        return min(1.0, max(parts)) if parts else None

    def line(self) -> str:
        c = self.counters
        f = self.fraction()
        bar = "" if f is None else "[" + ("#" * round(f * BAR_WIDTH)).ljust(BAR_WIDTH, ".") + f"] {f:4.0%} "
        p50 = stats.percentile(c.recent_ttfts, 50)
        total = f"/{self.count}" if self.count else ""
        return (f"{bar}{time.perf_counter() - self.t0:6.1f}s  done {c.done}{total}  ok {c.ok}  err {c.failed}  "
                f"in flight {c.in_flight}" + (f"  ttft p50 {p50:.3f}s" if p50 is not None else ""))

    def draw(self, final: bool = False) -> None:
        tty = self.out.isatty()
        end = "\n" if final or not tty else ""
        print(("\r" if tty else "") + self.line().ljust(100), end=end, file=self.out, flush=True)

    async def run(self) -> None:
        """Redraw until cancelled."""
        tty = self.out.isatty()
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.5)
            now = time.perf_counter()
            if tty or now - last >= self.log_every_s:
                self.draw()
                last = now

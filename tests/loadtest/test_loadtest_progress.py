"""The live progress bar: its fill follows whichever bound (count or duration) is nearer, its
counters follow the requests, and into a file it writes a line now and then, never carriage returns."""
from __future__ import annotations

import asyncio
import io
import time

from loadtest.progress import Counters, Progress


def test_counters_and_the_bar_fill():
    c = Counters()
    for _ in range(3):
        c.started()
    c.ended("ok", 0.5, True)
    c.ended("http_429", None, True)
    c.ended("ok", 0.7, True)
    c.ended("aborted", None, False)  # never counted as sent (cancelled while waiting for its session's last turn)
    assert (c.sent, c.done, c.ok, c.failed, c.in_flight, c.max_in_flight) == (3, 4, 2, 1, 0, 3)
    p = Progress(c, count=8, duration_s=None, t0=time.perf_counter())
    assert p.fraction() == 0.5
    line = p.line()
    assert line.startswith("[" + "#" * 12 + "." * 12 + "]  50%")
    assert "done 4/8" in line and "err 1" in line and "ttft p50 0.600s" in line
    assert Progress(c, count=100, duration_s=10.0, t0=time.perf_counter() - 5.0).fraction() >= 0.5  # time leads
    assert Progress(c, count=None, duration_s=None, t0=time.perf_counter()).line().startswith(" ")  # no bar


def test_into_a_file_it_logs_lines_not_redraws():
    out = io.StringIO()  # not a terminal
    p = Progress(Counters(), count=5, duration_s=None, t0=time.perf_counter(), out=out, log_every_s=0.4)

    async def main():
        task = asyncio.ensure_future(p.run())
        await asyncio.sleep(1.3)
        task.cancel()

    asyncio.run(main())
    p.draw(final=True)
    text = out.getvalue()
    assert "\r" not in text and 2 <= text.count("\n") <= 4 and "done 0/5" in text

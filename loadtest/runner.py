"""The asyncio driver of one run: requests from a workload, sent by an arrival process to one
target, bounded by a count and/or a duration; client aborts; ``/metrics`` scraped before and after;
a live progress line on stderr. Returns the run as a dict (records, summary, server deltas).

Open loop (poisson, constant, burst, trace): each request is sent at its offset whatever is in
flight (``max_concurrency`` caps it: the send then waits for a slot, and ``sent_s`` shows it).
Closed loop (concurrency): ``concurrency`` workers, each sending its next request when its last
one ends. Agent sessions: turn t of a session is sent only after turn t-1 has ended.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable, Iterable

import httpx

from loadtest import arrival as arrivals
from loadtest import client as cl
from loadtest import breakdown, promscrape, stats
from loadtest.progress import Counters, Progress
from loadtest.workloads import Request


@dataclass
class RunConfig:
    arrival: str = "poisson"
    rate: float | None = None
    concurrency: int | None = None  # the closed loop's workers
    max_concurrency: int | None = None  # open loop: at most this many in flight
    burst_size: int = 1
    burst_interval: float = 1.0
    count: int | None = None
    duration_s: float | None = None
    seed: int = 0
    abort_share: float = 0.0
    abort_min_s: float = 0.1
    abort_max_s: float = 5.0
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    itl_stat: str = "mean"
    metrics_url: str | None = None  # default: the target's URL ("" = do not scrape)
    progress: bool = True
    tags: dict = field(default_factory=dict)

    def check(self) -> None:
        if self.count is None and self.duration_s is None:
            raise ValueError("bound the run with --count and/or --duration")
        if self.arrival == "concurrency" and not (self.concurrency and self.concurrency >= 1):
            raise ValueError("the concurrency arrival needs --concurrency >= 1")
        if not 0.0 <= self.abort_share <= 1.0 or self.abort_min_s < 0 or self.abort_max_s < self.abort_min_s:
            raise ValueError("need 0 <= --abort-share <= 1 and 0 <= --abort-min <= --abort-max")


Background = Callable[[float], Awaitable[None]]  # given the run's t0 (perf_counter), runs until cancelled


async def run(target: cl.Target, cfg: RunConfig, requests: Iterable[Request], *,
              background: list[Background] = (), http: httpx.AsyncClient | None = None) -> dict:
    """Run the requests against ``target``; returns the run's dict."""
    cfg.check()
    own_http = http is None
    if own_http:  # model discovery and /metrics scrapes
        http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=min(30.0, target.timeout_s)))
    grpc_client = session = None
    try:
        metrics_base = cl.base_url(cfg.metrics_url if cfg.metrics_url is not None else target.url or "")
        if target.grpc:
            from prefill_server.client import AsyncPrefillClient  # gRPC mode only

            grpc_client = AsyncPrefillClient(target.grpc, api_key=target.api_key)
        else:
            session = cl.new_session(target)  # the requests' client; ``http`` for the side calls
            if target.model is None:
                target.model = await discover_model(http, target)
        before, before_err = (await promscrape.scrape(http, metrics_base, target.headers())) if metrics_base \
            else (None, "not scraped")
        started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        records, st, t0, duration = await _drive(target, cfg, requests, session, grpc_client, background)
        after, after_err = (await promscrape.scrape_settled(http, metrics_base, target.headers())) if metrics_base \
            else (None, "not scraped")
    finally:
        if grpc_client is not None:
            await grpc_client.close()
        if session is not None:
            await session.close()
        if own_http:
            await http.aclose()
    server = promscrape.deltas(before, after)
    if before_err or after_err:
        server["scrape_error"] = before_err or after_err
    summary = stats.summarize(records, duration, slo_ttft_s=cfg.slo_ttft_s, slo_itl_s=cfg.slo_itl_s,
                              itl_stat=cfg.itl_stat)
    summary["max_in_flight"] = st.max_in_flight
    target_d = {k: v for k, v in asdict(target).items() if k != "api_key"}
    return {"label": target.label, "target": target_d, "config": asdict(cfg), "started_at": started_at,
            "duration_s": duration, "t0_monotonic_s": t0, "records": records, "summary": summary, "server": server,
            "breakdown": breakdown.compute(summary, server)}


async def discover_model(http: httpx.AsyncClient, target: cl.Target) -> str | None:
    """The first model of GET /v1/models (None when the server does not say)."""
    try:
        r = await http.get(cl.base_url(target.url) + "/v1/models", headers=target.headers(), timeout=30)
        return r.json()["data"][0]["id"] if r.status_code == 200 else None
    except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError, TypeError):
        return None


async def _drive(target, cfg: RunConfig, requests, session, grpc_client, background):
    st = Counters()
    records: list[dict] = []
    t0 = time.perf_counter()
    deadline = t0 + cfg.duration_s if cfg.duration_s is not None else None
    stream = iter(requests if cfg.count is None else itertools.islice(requests, cfg.count))
    abort_rng = random.Random(f"abort:{cfg.seed}")
    sessions: dict[str, asyncio.Future] = {}
    bg = [asyncio.ensure_future(b(t0)) for b in background]
    bar = Progress(st, cfg.count, cfg.duration_s, t0) if cfg.progress else None
    progress = asyncio.ensure_future(bar.run()) if bar is not None else None
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    async def one(req: Request, scheduled: float | None) -> None:
        rec = cl.new_record(req, target.label)
        rec["scheduled_s"] = scheduled
        records.append(rec)
        abort_after = abort_rng.uniform(cfg.abort_min_s, cfg.abort_max_s) if (
            cfg.abort_share and abort_rng.random() < cfg.abort_share) else None
        prev = sessions.get(req.session) if req.session is not None else None
        mine = asyncio.get_running_loop().create_future() if req.session is not None else None
        if req.session is not None:
            sessions[req.session] = mine
        counted = False
        try:
            if prev is not None:
                await prev  # the previous turn of this session has ended
            st.started()
            counted = True
            if grpc_client is not None:
                work = asyncio.ensure_future(cl.grpc_request(grpc_client, target, req, rec, t0))
            else:
                work = asyncio.ensure_future(cl.http_request(session, target, req, rec, t0))
            if abort_after is None:
                await work
            else:
                rec["abort_after_s"] = abort_after
                finished, _ = await asyncio.wait({work}, timeout=abort_after)
                if not finished:
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    rec["status"], rec["error"] = "aborted", f"cancelled by the client after {abort_after:.3f} s"
                    rec["e2e_s"] = None
        except Exception as e:  # a bug of ours must not lose the record
            rec["status"], rec["error"] = "client_bug", f"{type(e).__name__}: {e}"
        finally:
            rec["end_s"] = time.perf_counter() - t0
            st.ended(rec["status"], rec["ttft_s"], counted)
            if mine is not None and not mine.done():
                mine.set_result(None)

    tasks: list[asyncio.Task] = []
    try:
        if cfg.arrival == "concurrency":
            lock = asyncio.Lock()

            async def worker():
                while True:
                    async with lock:
                        if deadline is not None and time.perf_counter() >= deadline:
                            return
                        req = next(stream, None)
                    if req is None:
                        return
                    await one(req, time.perf_counter() - t0)

            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        else:
            offsets = arrivals.offsets(cfg.arrival, rate=cfg.rate, seed=cfg.seed, burst_size=cfg.burst_size,
                                       burst_interval=cfg.burst_interval)
            for req in stream:
                at = req.at_s if offsets is None else next(offsets)
                if at is None:
                    raise ValueError("the trace arrival needs a workload with timestamps (--workload trace)")
                if cfg.duration_s is not None and at >= cfg.duration_s:
                    break
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if sem is not None:
                    await sem.acquire()
                task = asyncio.ensure_future(one(req, at))
                if sem is not None:
                    task.add_done_callback(lambda _t: sem.release())
                tasks.append(task)
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        for b in bg:
            b.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
        if progress is not None:
            progress.cancel()
            await asyncio.gather(progress, return_exceptions=True)
            bar.draw(final=True)
    duration = time.perf_counter() - t0
    records.sort(key=lambda r: r["index"])
    return records, st, t0, duration

"""Soak mode: a long run with client aborts and injected faults, checked against invariants.

Faults: ``--inject AT_SECONDS:COMMAND`` runs ``COMMAND`` in a shell at that time of the run (e.g.
one that SIGKILLs a decode and starts it again). A fault's window is from its command's start to
``fault_window_s`` after the command ends; requests that overlap one may fail in the ways a fault
explains (below).

Invariants (each ``pass`` true, false, or null when it could not be measured):

- ``every_request_ended_clearly``: each request ended ok, aborted by us, with an HTTP error status,
  with a stream error event, or as a gRPC error; a connection error only inside a fault window;
  never a client timeout, a stream cut without an error event, or anything unclassified. A client
  timeout or connection error during a stall of the load generator itself (its event loop did not
  run for ``STALL_S`` or more: a starved or paused client machine) is not judged, and the stalls are
  reported (``generator_stalls_s``): the client's own timers ran out while it could not look;
- ``no_unexpected_5xx``: no 5xx but 502/503, and 502/503 only inside fault windows (unless
  ``allow_503_outside_faults``); error events' codes count as statuses;
- ``kv_blocks_back_to_zero``: after the run, ``prefill_server:kv_blocks_in_use`` reaches 0 within
  ``blocks_timeout_s`` (null when the target does not export it);
- ``injections_succeeded``: every injection due within the run ran and exited 0;
- ``server_rss_growth`` (with ``server_pid``): the process lived through the run and its RSS at the
  end (median of the last 5 s of samples) is at most ``rss_max_growth_pct`` percent above its RSS
  after the warm-up (median of the 5 s after ``rss_warmup_s``);
- ``graceful_drain`` (with ``drain``): SIGTERM under load at the end (``drain.py``).

The verdict passes when no invariant fails.
"""
from __future__ import annotations

import asyncio
import pathlib
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

from loadtest import client as cl
from loadtest import drain as dr
from loadtest import promscrape, runner

CLEAR = {"ok", "aborted", "http_429", "http_4xx", "http_5xx", "stream_error"}
STALL_S = 2.0  # the generator's event loop late by this much: the client machine stalled


@dataclass
class SoakConfig:
    injections: list[tuple[float, str]] = field(default_factory=list)
    fault_window_s: float = 30.0
    inject_timeout_s: float = 300.0
    blocks_timeout_s: float = 60.0
    server_pid: int | None = None
    rss_warmup_s: float = 60.0
    rss_max_growth_pct: float = 5.0
    rss_interval_s: float = 1.0
    allow_503_outside_faults: bool = False
    drain: dr.DrainConfig | None = None  # SIGTERM the server under load once the checks above are made


def parse_inject(spec: str) -> tuple[float, str]:
    """``AT_SECONDS:COMMAND`` -> (seconds, command)."""
    at, sep, cmd = spec.partition(":")
    try:
        seconds = float(at)
    except ValueError:
        seconds = -1.0
    if not sep or seconds < 0 or not cmd.strip():
        raise ValueError(f"--inject {spec!r}: write AT_SECONDS:COMMAND, e.g. 30:'kill -9 1234'")
    return seconds, cmd


class _Injector:
    def __init__(self, specs: list[tuple[float, str]], timeout_s: float):
        self.specs, self.timeout_s = sorted(specs, key=lambda x: x[0]), timeout_s
        self.log: list[dict] = [{"at_s": at, "command": cmd, "ran": False} for at, cmd in self.specs]
        self.tasks: list[asyncio.Task] = []

    async def schedule(self, t0: float) -> None:
        for entry in self.log:
            delay = t0 + entry["at_s"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self.tasks.append(asyncio.ensure_future(self._one(entry, t0)))

    async def _one(self, entry: dict, t0: float) -> None:
        entry.update(ran=True, started_s=time.perf_counter() - t0)
        proc = await asyncio.create_subprocess_shell(entry["command"], stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.timeout_s)
            entry["rc"] = proc.returncode
            entry["output_tail"] = out.decode(errors="replace")[-2000:]
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            entry["rc"], entry["error"] = None, f"killed after {self.timeout_s:g} s"
        entry["ended_s"] = time.perf_counter() - t0

    async def finish(self) -> None:
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


class _Rss:
    def __init__(self, pid: int, interval_s: float):
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[float, float]] = []  # (seconds, MiB)
        self.gone_at: float | None = None

    async def sample(self, t0: float) -> None:
        while True:
            mb = read_rss_mb(self.pid)
            now = time.perf_counter() - t0
            if mb is None:
                self.gone_at = now
                return
            self.samples.append((now, mb))
            await asyncio.sleep(self.interval_s)


def read_rss_mb(pid: int) -> float | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


class _Stalls:
    """Intervals (s into the run) in which this process's event loop did not run for STALL_S or more."""

    def __init__(self, tick_s: float = 0.1):
        self.tick_s = tick_s
        self.windows: list[tuple[float, float]] = []

    async def watch(self, t0: float) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.perf_counter()
            if now - last - self.tick_s >= STALL_S:
                self.windows.append((last - t0, now - t0))
            last = now


async def soak(target: cl.Target, cfg: runner.RunConfig, soak_cfg: SoakConfig, requests) -> dict:
    """The run (with injections, RSS sampling and the stall watch beside it), then the invariants."""
    injector = _Injector(soak_cfg.injections, soak_cfg.inject_timeout_s)
    rss = _Rss(soak_cfg.server_pid, soak_cfg.rss_interval_s) if soak_cfg.server_pid else None
    stalls = _Stalls()
    background = [injector.schedule, stalls.watch] + ([rss.sample] if rss else [])
    result = await runner.run(target, cfg, requests, background=background)
    await injector.finish()
    blocks = await wait_blocks_zero(cl.base_url(cfg.metrics_url if cfg.metrics_url is not None else target.url),
                                    target.headers(), soak_cfg.blocks_timeout_s)
    drained = await dr.drain(target, cfg, soak_cfg.drain, requests) if soak_cfg.drain else None
    result["soak"] = verdict(result["records"], injector.log, blocks, rss, soak_cfg, result["duration_s"], drained,
                             stalls.windows)
    return result


async def wait_blocks_zero(base: str, headers: dict, timeout_s: float) -> dict:
    """Poll /metrics until kv_blocks_in_use is 0: {"in_use": last value, "waited_s": ...}."""
    t0 = time.perf_counter()
    last, err = None, None
    async with httpx.AsyncClient() as http:
        while True:
            samples, err = await promscrape.scrape(http, base, headers) if base else (None, "no metrics URL")
            last = promscrape.value(samples, promscrape.BLOCKS_IN_USE) if samples else None
            waited = time.perf_counter() - t0
            if (samples is not None and last is None) or last == 0 or waited >= timeout_s:
                return {"in_use": last, "waited_s": waited, "error": err}
            await asyncio.sleep(0.5)


def _windows(log: list[dict], window_s: float) -> list[tuple[float, float]]:
    return [(e["started_s"], e.get("ended_s", e["started_s"]) + window_s) for e in log if e.get("ran")]


def _overlaps(rec: dict, windows) -> bool:
    start = rec.get("sent_s")
    end = rec.get("end_s", start)
    if start is None:
        return False
    return any(start <= w_end and end >= w_start for w_start, w_end in windows)


def _codes(rec: dict) -> int | None:
    if rec.get("http_status") and rec["http_status"] >= 500:
        return rec["http_status"]
    code = rec.get("error_code")
    return code if isinstance(code, int) and code >= 500 else None


def verdict(records: list[dict], log: list[dict], blocks: dict, rss: _Rss | None, c: SoakConfig,
            duration_s: float, drained: dict | None = None, stalls: list[tuple[float, float]] = ()) -> dict:
    windows = _windows(log, c.fault_window_s)
    inv: dict[str, dict] = {}

    stalled = {id(r) for r in records if r.get("status") in ("timeout", "connection") and _overlaps(r, stalls)}
    unclear = [r for r in records if r.get("status") not in CLEAR
               and not str(r.get("status")).startswith("grpc_")
               and not (r.get("status") == "connection" and _overlaps(r, windows))
               and id(r) not in stalled]
    inv["every_request_ended_clearly"] = {
        "pass": not unclear, "detail": f"{len(unclear)} of {len(records)} requests ended unclearly"
        + (": " + ", ".join(f"#{r['index']} {r.get('status')}" for r in unclear[:10]) if unclear else "")
        + (f"; {len(stalled)} timed out or failed to connect while the load generator itself was stalled "
           f"(not judged)" if stalled else "")}

    bad = []
    for r in records:
        code = _codes(r)
        if code is None:
            continue
        if code not in (502, 503) or (not _overlaps(r, windows) and not c.allow_503_outside_faults):
            bad.append(f"#{r['index']} {code}" + ("" if code not in (502, 503) else " outside a fault window"))
    inv["no_unexpected_5xx"] = {"pass": not bad, "detail": f"{len(bad)} unexpected 5xx"
                                + (": " + ", ".join(bad[:10]) if bad else "")}

    if blocks.get("in_use") is None:
        inv["kv_blocks_back_to_zero"] = {"pass": None, "detail": "not measured: " + (
            blocks.get("error") or f"the target exports no {promscrape.BLOCKS_IN_USE}")}
    else:
        inv["kv_blocks_back_to_zero"] = {
            "pass": blocks["in_use"] == 0,
            "detail": f"{blocks['in_use']:g} blocks in use {blocks['waited_s']:.1f} s after the run"}

    due = [e for e in log if e["at_s"] < duration_s]
    failed = [e for e in due if not e.get("ran") or e.get("rc") != 0]
    inv["injections_succeeded"] = {
        "pass": not failed if due else None,
        "detail": (f"{len(due) - len(failed)} of {len(due)} injections ran and exited 0" if due
                   else "no injection was due")
        + ("; failed: " + ", ".join(f"{e['command']!r} rc={e.get('rc')}" for e in failed) if failed else "")}

    if rss is None:
        inv["server_rss_growth"] = {"pass": None, "detail": "not measured (no --server-pid)"}
    else:
        inv["server_rss_growth"] = _rss_invariant(rss, c)

    inv["graceful_drain"] = ({k: v for k, v in drained.items() if k != "records"} if drained is not None
                             else {"pass": None, "detail": "not asked for (--drain)"})
    ok = all(v["pass"] is not False for v in inv.values())
    return {"verdict": "pass" if ok else "fail", "invariants": inv, "injections": log,
            "fault_windows_s": windows, "generator_stalls_s": [list(w) for w in stalls], "blocks_after_run": blocks,
            "rss_samples_mb": [(round(t, 2), round(m, 1)) for t, m in rss.samples] if rss else None,
            "drain_records": drained["records"] if drained is not None else None,
            "config": {k: v for k, v in asdict(c).items() if k != "injections"}}


def _rss_invariant(rss: _Rss, c: SoakConfig) -> dict:
    if rss.gone_at is not None:
        return {"pass": False, "detail": f"process {rss.pid} was gone {rss.gone_at:.1f} s into the run"}
    after = [t for t, _ in rss.samples if t >= c.rss_warmup_s]
    if not after:
        return {"pass": None, "detail": f"the run was shorter than the warm-up ({c.rss_warmup_s:g} s)"}
    # the first 5 s of samples from the warm-up's end (a stalled machine may have taken none right at it)
    warm = [m for t, m in rss.samples if after[0] <= t < after[0] + 5.0]
    t_end = rss.samples[-1][0]
    end = [m for t, m in rss.samples if t >= t_end - 5.0]
    base, last = statistics.median(warm), statistics.median(end)
    pct = 100.0 * (last - base) / base
    return {"pass": pct <= c.rss_max_growth_pct, "baseline_mb": base, "end_mb": last, "growth_pct": pct,
            "max_mb": max(m for _, m in rss.samples),
            "detail": f"RSS {base:.0f} -> {last:.0f} MiB ({pct:+.1f}%; limit +{c.rss_max_growth_pct:g}%)"}

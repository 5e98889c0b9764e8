"""The soak's last step: a graceful drain under load, as Kubernetes ends a pod.

After the soak's run (and its KV-blocks check, which needs the server alive), ``requests`` more
requests are sent at once, the server process gets SIGTERM ``delay_s`` later while they are in
flight, and then:

- each of them must end ok or with a clear error (an HTTP status, an error event, a refused
  connection once the server is gone), never a timeout, a reset, or a stream cut without a word;
- the process must be gone within ``timeout_s`` of the SIGTERM.

The exit status of a process we did not start cannot be read; the server's log has it.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

from loadtest import client as cl
from loadtest import runner

# how a request may end while the server drains: admitted ones finish (ok) or fail with a status;
# new ones are refused (a 503, or the connection once the listener is closed: ``refused``)
CLEAR = {"ok", "aborted", "http_429", "http_4xx", "http_5xx", "stream_error"}


def _clear(rec: dict) -> bool:
    return rec["status"] in CLEAR or (rec["status"] == "connection" and bool(rec.get("refused")))


@dataclass(frozen=True)
class DrainConfig:
    pid: int
    requests: int = 4
    delay_s: float = 0.5
    timeout_s: float = 60.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # our own child that has exited stays a zombie until reaped: that is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def drain(target: cl.Target, cfg: runner.RunConfig, c: DrainConfig, requests) -> dict:
    """Send ``c.requests`` requests, SIGTERM the server while they run; the invariant's dict."""
    sent_term: dict = {}

    async def terminate(t0: float) -> None:
        await asyncio.sleep(c.delay_s)
        os.kill(c.pid, signal.SIGTERM)
        sent_term["at"] = time.perf_counter()

    run_cfg = runner.RunConfig(arrival="concurrency", concurrency=c.requests, count=c.requests, seed=cfg.seed + 1,
                               metrics_url="", progress=False)
    run = await runner.run(target, run_cfg, requests, background=[terminate])
    if "at" not in sent_term:
        return {"pass": False, "detail": f"no SIGTERM sent: the {c.requests} requests ended within "
                f"{c.delay_s:g} s (lower --drain-delay)",
                "exited_after_s": None, "by_kind": run["summary"]["by_kind"], "records": run["records"]}
    while _alive(c.pid) and time.perf_counter() - sent_term["at"] < c.timeout_s:
        await asyncio.sleep(0.1)
    exited = None if _alive(c.pid) else time.perf_counter() - sent_term["at"]
    unclear = [r for r in run["records"] if not _clear(r)]
    kinds = run["summary"]["by_kind"]
    detail = (f"SIGTERM {c.delay_s:g} s after {c.requests} requests were sent; they ended {kinds}; "
              + (f"the process was gone {exited:.1f} s after it" if exited is not None
                 else f"the process still ran {c.timeout_s:g} s after it")
              + ("; unclear endings: " + ", ".join(f"#{r['index']} {r['status']}" for r in unclear) if unclear else ""))
    return {"pass": exited is not None and not unclear, "detail": detail, "exited_after_s": exited,
            "by_kind": kinds, "records": run["records"]}

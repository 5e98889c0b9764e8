"""``python -m loadtest run|sweep|soak|compare|report``: every option with its help.

run     one run (per target: the server, and with --baseline-url a vLLM alone on the same workload)
sweep   one run per rate of --rates (per target)
soak    a long run with client aborts, injected faults and invariants; writes a verdict
compare the key numbers of result JSONs side by side (text, and HTML with --html)
report  the HTML report (PNG plots next to it) of a result JSON

Exit status: 0, or 1 when a soak verdict fails, 2 for a usage error.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import pathlib
import shlex
import sys

from loadtest import compare as cmp
from loadtest import drain, runner, soak, workloads
from loadtest.arrival import ARRIVALS
from loadtest.client import Target
from loadtest.text import TextSource

API_KEY_ENV = "PREFILL_SERVER_API_KEY"


def _floats(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: write numbers separated by commas, e.g. 0.5,1,2") from None
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError("rates must be > 0")
    return out


def _target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine); "
                   "requests go to its /v1/completions or /v1/chat/completions, /metrics is scraped before and after")
    g.add_argument("--label", default="prefill-server", help="the target's name in results and plots "
                   "(default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"sent as 'Authorization: Bearer KEY' (HTTP and gRPC, /metrics too); default: ${API_KEY_ENV}")
    g.add_argument("--model", help="the model name sent in requests (default: the first of GET /v1/models)")
    g.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="OpenAI API: completions (the messages' contents joined by blank lines) or chat "
                   "(default: %(default)s)")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="streamed answers (TTFT and ITL measured per token; --no-stream: TTFT = the whole "
                   "answer's time) (default: on)")
    g.add_argument("--max-tokens", type=int, default=64, help="output tokens per request unless the workload "
                   "says (a trace's output_tokens) (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (vLLM): every answer has exactly max_tokens tokens")
    g.add_argument("--no-usage", action="store_true", help="do not ask for stream_options.include_usage "
                   "(output tokens are then counted as streamed chunks)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before the client gives up on a request: status 'timeout' (default: %(default)s)")
    g.add_argument("--retries", type=int, default=0, help="retry a 429/503 that has a Retry-After this many "
                   "times, after waiting it out (the OpenAI SDK's default is 2) (default: %(default)s)")
    g.add_argument("--retry-max-wait", type=float, default=60.0,
                   help="never wait longer than this for a Retry-After (default: %(default)s)")
    g.add_argument("--grpc", metavar="HOST:PORT", help="prefill-only requests through the gRPC API "
                   "(AsyncPrefillClient.prefill, then release): TTFT = the prefill call's time; --url is then "
                   "only for /metrics")
    g.add_argument("--metrics-url", help="where to scrape /metrics (default: --url; '' to skip)")
    g.add_argument("--baseline-url", help="baseline mode: also send the same workload to this OpenAI server "
                   "(e.g. a vLLM decode alone, prefilling itself), as a second run per load")
    g.add_argument("--baseline-label", default="vllm-alone", help="the baseline's name (default: %(default)s)")
    g.add_argument("--baseline-model", help="the model name for the baseline (default: its /v1/models)")


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=workloads.WORKLOADS, default="rag",
                   help="rag | longdoc | needle | agent | mix | trace (see docs/loadtest.md) (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="same seed, same requests and arrivals (default: %(default)s)")
    g.add_argument("--text-source", default="licenses", help="licenses (/usr/share/common-licenses), words "
                   "(generated, machine-independent), or a text file/folder (default: %(default)s)")
    g.add_argument("--chars-per-token", type=float, default=4.0,
                   help="length estimate without --tokenizer (default: %(default)s)")
    g.add_argument("--tokenizer", help="a tokenizer.json or a model folder with one: exact token lengths")
    d = workloads.WorkloadParams()
    opts = [
        ("--rag-system-tokens", int, "rag: tokens of the shared system prompt"),
        ("--rag-passages", int, "rag: passages per request"),
        ("--rag-passage-tokens", int, "rag: tokens per passage"),
        ("--rag-pool", int, "rag: passages to draw from, uniformly (a small pool: passages recur)"),
        ("--doc-min-tokens", int, "longdoc/needle: shortest document (log-uniform lengths)"),
        ("--doc-max-tokens", int, "longdoc/needle: longest document (at most 131072 without --allow-huge)"),
        ("--agent-system-tokens", int, "agent: tokens of the system prompt shared by all sessions"),
        ("--agent-first-tokens", int, "agent: tokens of a session's first user message"),
        ("--agent-turn-tokens", int, "agent: tokens of each later turn's tool result"),
        ("--agent-reply-tokens", int, "agent: tokens of each (generated) assistant turn in the history"),
        ("--agent-turns", int, "agent: turns per session"),
        ("--agent-parallel", int, "agent: sessions interleaved at a time"),
        ("--short-min-tokens", int, "mix: shortest short prompt"),
        ("--short-max-tokens", int, "mix: longest short prompt"),
        ("--long-min-tokens", int, "mix: shortest long prompt"),
        ("--long-max-tokens", int, "mix: longest long prompt"),
        ("--long-share", float, "mix: share of long prompts"),
        ("--trace-speedup", float, "trace: divide the trace's timestamps by this"),
    ]
    for flag, typ, help_ in opts:
        name = flag[2:].replace("-", "_")
        g.add_argument(flag, type=typ, default=getattr(d, name), help=f"{help_} (default: %(default)s)")
    g.add_argument("--allow-huge", action="store_true", help="longdoc/needle: allow documents up to 1M tokens")
    g.add_argument("--trace", help="trace: a JSONL file, one request a line: {\"timestamp\": s, "
                   "\"prompt_tokens\": n | \"prompt\": text, \"output_tokens\": n (optional)}")
    g.add_argument("--warmup", type=int, default=0, help="requests sent one at a time before each target's "
                   "first run, not recorded (another seed of the same workload) (default: %(default)s)")


def _load_args(p: argparse.ArgumentParser, sweep: bool = False, need_duration: bool = False) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--arrival", choices=ARRIVALS, help="poisson | constant | burst | concurrency (closed loop) | "
                   "trace (default: trace for --workload trace, concurrency when --concurrency is given "
                   "without a rate, else poisson)")
    if sweep:
        g.add_argument("--rates", type=_floats, required=True, help="requests/s, one run each, e.g. 0.5,1,2,4")
        g.add_argument("--cooldown", type=float, default=0.0,
                       help="seconds of pause between the runs of a sweep (default: %(default)s)")
    else:
        g.add_argument("--rate", type=float, help="requests/s (poisson, constant)")
    g.add_argument("--concurrency", type=int, help="the concurrency arrival: requests in flight (closed loop)")
    g.add_argument("--max-concurrency", type=int, help="open loop: at most this many requests in flight")
    g.add_argument("--burst-size", type=int, default=8, help="burst: requests per burst (default: %(default)s)")
    g.add_argument("--burst-interval", type=float, default=5.0,
                   help="burst: seconds between bursts (default: %(default)s)")
    g.add_argument("--count", type=int, help="requests per run (a run also ends at --duration)")
    g.add_argument("--duration", type=float, required=need_duration,
                   help="seconds per run: no request is sent after it; those in flight finish")
    g.add_argument("--abort-share", type=float, default=0.1 if need_duration else 0.0,
                   help="share of requests the client cancels after a random delay (default: %(default)s)")
    g.add_argument("--abort-min", type=float, default=0.1, help="shortest abort delay, s (default: %(default)s)")
    g.add_argument("--abort-max", type=float, default=5.0, help="longest abort delay, s (default: %(default)s)")
    s = p.add_argument_group("SLOs and output")
    s.add_argument("--slo-ttft", type=float, help="goodput: TTFT SLO in seconds")
    s.add_argument("--slo-itl", type=float, help="goodput: inter-token latency SLO in seconds")
    s.add_argument("--slo-itl-stat", choices=("mean", "max"), default="mean",
                   help="goodput: a request's ITL is the mean or the max of its gaps (default: %(default)s)")
    s.add_argument("--out", required=True, help="the result JSON (every request, summaries, server deltas)")
    s.add_argument("--html", help="also write the HTML report here (PNGs next to it; needs matplotlib)")
    s.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def _soak_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("soak")
    g.add_argument("--inject", action="append", default=[], metavar="AT_SECONDS:COMMAND",
                   help="run COMMAND in a shell AT_SECONDS into the run (repeatable), e.g. "
                   "'120:kill -9 $(cat decode.pid) && ./start-decode.sh'")
    g.add_argument("--fault-window", type=float, default=30.0, help="seconds after an injected command ends "
                   "during which connection errors and 502/503 are expected (default: %(default)s)")
    g.add_argument("--inject-timeout", type=float, default=300.0,
                   help="kill an injected command after this many seconds (default: %(default)s)")
    g.add_argument("--blocks-timeout", type=float, default=60.0, help="after the run, seconds for "
                   "prefill_server:kv_blocks_in_use to come back to 0 (default: %(default)s)")
    g.add_argument("--server-pid", type=int, help="sample this process's RSS and check its growth")
    g.add_argument("--rss-warmup", type=float, default=60.0,
                   help="RSS growth is measured from this many seconds into the run (default: %(default)s)")
    g.add_argument("--rss-max-growth-pct", type=float, default=5.0,
                   help="largest RSS growth after the warm-up, percent (default: %(default)s)")
    g.add_argument("--rss-interval", type=float, default=1.0, help="RSS sampling period, s (default: %(default)s)")
    g.add_argument("--drain", action="store_true", help="at the end, SIGTERM --server-pid while "
                   "--drain-requests requests are in flight: each must end ok or with a clear error, and the "
                   "process must exit within --drain-timeout")
    g.add_argument("--drain-requests", type=int, default=4, help="requests in flight at the SIGTERM "
                   "(default: %(default)s)")
    g.add_argument("--drain-delay", type=float, default=0.5, help="seconds from sending them to the SIGTERM "
                   "(default: %(default)s)")
    g.add_argument("--drain-timeout", type=float, default=60.0, help="seconds the process has to exit after "
                   "the SIGTERM (default: %(default)s)")
    g.add_argument("--allow-503-outside-faults", action="store_true",
                   help="do not fail on 502/503 outside fault windows (e.g. KV pool exhaustion under overload)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("run", "one run per target"), ("sweep", "one run per rate per target"),
                        ("soak", "a long run with aborts, injected faults and invariants")):
        p = sub.add_parser(name, help=help_, description=help_)
        _target_args(p)
        _workload_args(p)
        _load_args(p, sweep=name == "sweep", need_duration=name == "soak")
        if name == "soak":
            _soak_args(p)
    c = sub.add_parser("compare", help="key numbers of result JSONs side by side",
                       description="key numbers of result JSONs side by side (each run a column)")
    c.add_argument("files", nargs="+", help="result JSONs of run, sweep or soak")
    c.add_argument("--html", help="also write the table as HTML here")
    c.add_argument("--text", help="also write the text table here (it is printed either way)")
    r = sub.add_parser("report", help="the HTML report of a result JSON",
                       description="the HTML report of a result JSON (PNG plots next to it; needs matplotlib)")
    r.add_argument("file", help="a result JSON")
    r.add_argument("--html", help="where to write it (default: the JSON's path with .html)")
    return ap


def _arrival(a) -> str:
    if a.arrival:
        return a.arrival
    if a.workload == "trace":
        return "trace"
    if a.concurrency and not getattr(a, "rate", None) and not getattr(a, "rates", None):
        return "concurrency"
    return "poisson"


def _targets(a) -> list[Target]:
    if not a.url and not a.grpc:
        raise ValueError("give --url (HTTP) or --grpc (prefill-only)")
    base = Target(label=a.label, url=a.url or "", model=a.model, api=a.api, stream=a.stream, api_key=a.api_key,
                  max_tokens=a.max_tokens, temperature=a.temperature, ignore_eos=a.ignore_eos,
                  include_usage=not a.no_usage, timeout_s=a.request_timeout, retries=a.retries,
                  retry_max_wait_s=a.retry_max_wait, grpc=a.grpc)
    out = [base]
    if a.baseline_url:
        out.append(dataclasses.replace(base, label=a.baseline_label, url=a.baseline_url, model=a.baseline_model,
                                       grpc=None))
    return out


def _run_config(a, rate: float | None) -> runner.RunConfig:
    return runner.RunConfig(
        arrival=_arrival(a), rate=rate, concurrency=a.concurrency, max_concurrency=a.max_concurrency,
        burst_size=a.burst_size, burst_interval=a.burst_interval, count=a.count, duration_s=a.duration,
        seed=a.seed, abort_share=a.abort_share, abort_min_s=a.abort_min, abort_max_s=a.abort_max,
        slo_ttft_s=a.slo_ttft, slo_itl_s=a.slo_itl, itl_stat=a.slo_itl_stat, metrics_url=a.metrics_url,
        progress=not a.quiet)


def _redacted(argv: list[str]) -> list[str]:
    """argv with the value of --api-key replaced: results are shared, keys are not."""
    out, hide = [], False
    for x in argv:
        out.append("***" if hide else "--api-key=***" if x.startswith("--api-key=") else x)
        hide = x == "--api-key"
    return out


def _doc(a, argv: list[str]) -> dict:
    argv = _redacted(argv)
    return {"tool": "loadtest", "format": 1, "mode": a.cmd,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m loadtest " + shlex.join(argv), "argv": argv,
            "options": {k: v for k, v in vars(a).items() if k != "api_key"}, "runs": []}


def _write(doc: dict, path: str) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(p)


async def _execute(a, argv: list[str]) -> dict:
    text = TextSource(a.text_source, chars_per_token=a.chars_per_token, tokenizer=a.tokenizer)
    params = workloads.params_from(a)
    params.check(a.workload)
    if a.workload == "trace" and a.count is None and a.duration is None:
        a.count = len(workloads.read_trace(a.trace))
    doc = _doc(a, argv)
    rates = a.rates if a.cmd == "sweep" else [a.rate]
    targets = _targets(a)
    warmed = set()
    for i, rate in enumerate(rates):
        if i and a.cmd == "sweep" and a.cooldown:
            await asyncio.sleep(a.cooldown)
        for t in targets:
            t = dataclasses.replace(t)
            if a.warmup and t.label not in warmed:
                warmed.add(t.label)
                await runner.run(t, dataclasses.replace(_run_config(a, None), arrival="concurrency", concurrency=1,
                                                        count=a.warmup, duration_s=None, abort_share=0.0,
                                                        metrics_url="", progress=False),
                                 workloads.make(a.workload, params, text, a.seed + 1_000_003))
            cfg = _run_config(a, rate)
            reqs = workloads.make(a.workload, params, text, a.seed)
            if not a.quiet:
                print(f"== {t.label}: {a.workload}, {cfg.arrival}"
                      + (f" {rate:g}/s" if rate else "") + (f", {cfg.count} requests" if cfg.count else "")
                      + (f", {cfg.duration_s:g} s" if cfg.duration_s else ""), file=sys.stderr)
            if a.cmd == "soak":
                sc = soak.SoakConfig(injections=[soak.parse_inject(s) for s in a.inject],
                                     fault_window_s=a.fault_window, inject_timeout_s=a.inject_timeout,
                                     blocks_timeout_s=a.blocks_timeout, server_pid=a.server_pid,
                                     rss_warmup_s=a.rss_warmup, rss_max_growth_pct=a.rss_max_growth_pct,
                                     rss_interval_s=a.rss_interval,
                                     allow_503_outside_faults=a.allow_503_outside_faults,
                                     drain=drain.DrainConfig(a.server_pid, a.drain_requests, a.drain_delay,
                                                             a.drain_timeout) if a.drain else None)
                run = await soak.soak(t, cfg, sc, reqs)
                doc["soak_verdict"] = run["soak"]["verdict"]
            else:
                run = await runner.run(t, cfg, reqs)
            doc["runs"].append(run)
            _write(doc, a.out)  # after each run: a long sweep keeps what it has
        if a.cmd == "soak":
            break
    return doc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(argv)
    try:
        if a.cmd == "compare":
            print(cmp.compare(a.files, a.html, a.text), end="")
            return 0
        if a.cmd == "report":
            from loadtest import report

            html = a.html or str(pathlib.Path(a.file).with_suffix(".html"))
            report.write(cmp.load(a.file), html)
            print(html)
            return 0
        if a.cmd == "soak" and len(_targets(a)) > 1:
            raise ValueError("soak runs one target; drop --baseline-url")
        if a.cmd == "soak" and a.drain and not a.server_pid:
            raise ValueError("--drain needs --server-pid (the process to SIGTERM)")
        doc = asyncio.run(_execute(a, argv))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    print(cmp.text_table(*cmp.table(cmp.columns([("", doc)]))), end="")
    print(f"wrote {a.out}", file=sys.stderr)
    if a.html:
        from loadtest import report

        try:
            report.write(doc, a.html)
            print(f"wrote {a.html}", file=sys.stderr)
        except RuntimeError as e:
            print(f"loadtest: no HTML report: {e}", file=sys.stderr)
    if doc.get("soak_verdict") == "fail":
        print("soak verdict: FAIL", file=sys.stderr)
        return 1
    return 0

"""Soak: injected commands at their time, client aborts, invariants and the verdict; and gRPC
prefill-only requests (a fake PrefillService)."""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from concurrent import futures

import grpc
import pytest
from fake_openai import FakeOpenAI, Served, req

from loadtest import cli, runner, soak
from loadtest.client import Target
from prefill_server.serving.pb import prefill_pb2 as pb
from prefill_server.serving.pb import prefill_pb2_grpc as pb_grpc


def test_soak_with_an_injection_and_aborts_passes(tmp_path):
    marker = tmp_path / "injected"
    fake = FakeOpenAI(itl_s=0.02, blocks_release_delay_s=0.4)  # blocks come back a while after each answer
    with Served(fake) as s:
        out = tmp_path / "soak.json"
        rc = cli.main(["soak", "--url", s.url, "--workload", "mix", "--text-source", "words",
                       "--short-min-tokens", "5", "--short-max-tokens", "10", "--long-min-tokens", "20",
                       "--long-max-tokens", "30", "--max-tokens", "8", "--rate", "20", "--duration", "2.5",
                       "--abort-share", "0.3", "--abort-min", "0.01", "--abort-max", "0.08",
                       "--inject", f"0.5:touch {marker}", "--inject", "60:echo never",
                       "--server-pid", str(os.getpid()), "--rss-warmup", "0.5", "--rss-interval", "0.1",
                       "--rss-max-growth-pct", "100", "--blocks-timeout", "10", "--out", str(out), "--quiet"])
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    v = run["soak"]
    assert rc == 0 and doc["soak_verdict"] == "pass" == v["verdict"], v["invariants"]
    assert marker.exists()
    inj = v["injections"]
    assert inj[0]["ran"] and inj[0]["rc"] == 0 and abs(inj[0]["started_s"] - 0.5) < 0.3
    assert not inj[1]["ran"]  # due after the run: not run, not counted
    assert {k: x["pass"] for k, x in v["invariants"].items()} == {
        "every_request_ended_clearly": True, "no_unexpected_5xx": True, "kv_blocks_back_to_zero": True,
        "injections_succeeded": True, "server_rss_growth": True, "graceful_drain": None}
    assert run["summary"]["aborted"] > 0 and run["summary"]["by_kind"]["ok"] > 0
    assert v["blocks_after_run"]["in_use"] == 0 and v["blocks_after_run"]["waited_s"] > 0
    assert len(v["rss_samples_mb"]) > 5


def test_soak_verdict_fails_on_unclear_endings_5xx_and_failed_injections():
    fake = FakeOpenAI()
    with Served(fake) as s:
        t = Target(label="fake", url=s.url, max_tokens=3, timeout_s=1.0)
        cfg = runner.RunConfig(arrival="constant", rate=10, count=6, progress=False)
        reqs = [req(0), req(1, "[[status=500]]"), req(2, "[[no-done]]"), req(3, "[[status=503]]"), req(4, "[[hang]]"),
                req(5)]
        sc = soak.SoakConfig(injections=[(0.05, "exit 3")], fault_window_s=0.0, blocks_timeout_s=5)
        run = asyncio.run(soak.soak(t, cfg, sc, reqs))
    v = run["soak"]
    inv = v["invariants"]
    assert v["verdict"] == "fail"
    assert inv["every_request_ended_clearly"]["pass"] is False
    assert "#2 stream_incomplete" in inv["every_request_ended_clearly"]["detail"]
    assert "#4 timeout" in inv["every_request_ended_clearly"]["detail"]
    assert inv["no_unexpected_5xx"]["pass"] is False and "#1 500" in inv["no_unexpected_5xx"]["detail"]
    assert "#3 503 outside a fault window" in inv["no_unexpected_5xx"]["detail"]
    assert inv["injections_succeeded"]["pass"] is False and "rc=3" in inv["injections_succeeded"]["detail"]
    assert inv["server_rss_growth"]["pass"] is None  # no --server-pid
    assert inv["kv_blocks_back_to_zero"]["pass"] is True


def test_faults_explain_502_503_and_connection_errors_inside_their_window():
    log = [{"at_s": 1.0, "command": "x", "ran": True, "started_s": 1.0, "ended_s": 1.5, "rc": 0}]
    recs = [{"index": 0, "status": "http_5xx", "http_status": 503, "sent_s": 1.2, "end_s": 1.3},
            {"index": 1, "status": "connection", "http_status": None, "sent_s": 0.9, "end_s": 1.1},
            {"index": 2, "status": "stream_error", "error_code": 502, "http_status": 200, "sent_s": 2.0, "end_s": 2.2},
            {"index": 3, "status": "ok", "http_status": 200, "sent_s": 5.0, "end_s": 5.5}]
    blocks = {"in_use": 0.0, "waited_s": 0.1}
    v = soak.verdict(recs, log, blocks, None, soak.SoakConfig(fault_window_s=1.0), 10.0)
    assert v["verdict"] == "pass", v["invariants"]
    v = soak.verdict(recs, log, blocks, None, soak.SoakConfig(fault_window_s=0.0), 10.0)
    assert v["invariants"]["no_unexpected_5xx"]["pass"] is False  # #2's 502 came after the window
    assert soak.verdict(recs, log, blocks, None, soak.SoakConfig(fault_window_s=0.0, allow_503_outside_faults=True),
                        10.0)["invariants"]["no_unexpected_5xx"]["pass"] is True
    recs[1]["sent_s"], recs[1]["end_s"] = 0.1, 0.2
    v = soak.verdict(recs, log, blocks, None, soak.SoakConfig(fault_window_s=1.0), 10.0)
    assert v["invariants"]["every_request_ended_clearly"]["pass"] is False  # a connection error with no fault
    with pytest.raises(ValueError):
        soak.parse_inject("soon:touch x")
    assert soak.parse_inject("2.5:kill -9 1:2") == (2.5, "kill -9 1:2")


# ---- gRPC: prefill only ----
class _FakePrefill(pb_grpc.PrefillServiceServicer):
    """Prefill answers after 20 ms (RESOURCE_EXHAUSTED for prompts with [[busy]]); Release counts."""

    def __init__(self):
        self.released: list[str] = []
        self.ids = itertools.count()

    def Prefill(self, request, context):
        if "[[busy]]" in request.text:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake: busy")
        time.sleep(0.02)
        rid = f"r{next(self.ids)}"
        return pb.PrefillResponse(request_id=rid, first_token_id=5, first_token_text="x", model="fake-model",
                                  usage=pb.Usage(prompt_tokens=len(request.text) // 4 or len(request.messages)),
                                  timings=pb.Timings(queue_seconds=0.001, prefill_seconds=0.02, total_seconds=0.021))

    def Release(self, request, context):
        self.released.append(request.request_id)
        return pb.ReleaseResponse(released=True)


def test_grpc_prefill_only_measures_ttft_and_releases(fake):
    svc = _FakePrefill()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_PrefillServiceServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        t = Target(label="grpc", url=fake.url, grpc=f"127.0.0.1:{port}")  # url: only for /metrics
        cfg = runner.RunConfig(arrival="concurrency", concurrency=2, count=6, progress=False)
        reqs = [req(i, "[[busy]]" if i == 3 else "some prompt text") for i in range(6)]
        run = asyncio.run(runner.run(t, cfg, reqs))
        chat = asyncio.run(runner.run(Target(label="grpc", url="", grpc=f"127.0.0.1:{port}", api="chat"),
                                      runner.RunConfig(arrival="concurrency", concurrency=1, count=2,
                                                       progress=False), [req(10), req(11)]))
    finally:
        server.stop(0)
    s = run["summary"]
    assert s["by_kind"] == {"ok": 5, "grpc_RESOURCE_EXHAUSTED": 1}
    assert len(svc.released) == 7 and all(r["released"] for r in run["records"] if r["status"] == "ok")
    for r in run["records"]:
        if r["status"] == "ok":
            assert r["ttft_s"] >= 0.02 and r["server_timings"]["prefill_s"] == pytest.approx(0.02)
    assert s["server_timings_s"]["prefill_s"]["n"] == 5
    assert chat["summary"]["ok"] == 2 and chat["server"].get("scrape_error") == "not scraped"


# ---- the drain at the end of a soak ----
_SERVE_FAKE = ("import sys, uvicorn; from fake_openai import FakeOpenAI; "
               "uvicorn.run(FakeOpenAI(itl_s=0.05).app, host='127.0.0.1', port=int(sys.argv[1]), log_level='error')")


def test_drain_passes_when_the_server_finishes_its_requests_and_exits(tmp_path):
    import pathlib
    import socket
    import subprocess
    import sys

    import httpx

    from loadtest import drain

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = pathlib.Path(__file__).parent
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_FAKE, str(port)], cwd=here)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        t = Target(label="fake", url=url, max_tokens=10, timeout_s=20)  # 10 tokens 50 ms apart: ~0.5 s each
        got = asyncio.run(drain.drain(t, runner.RunConfig(count=1), drain.DrainConfig(proc.pid, 3, 0.2, 20.0),
                                      [req(i) for i in range(3)]))
        proc.wait(timeout=5)  # (its status is -15: uvicorn re-raises the signal once it has drained)
    finally:
        proc.kill()
    assert got["pass"] is True, got["detail"]
    assert got["by_kind"] == {"ok": 3}  # admitted before the SIGTERM: finished, not cut
    assert all(r["output_tokens"] == 10 for r in got["records"]) and got["exited_after_s"] < 20


def test_drain_fails_when_the_process_ignores_sigterm(fake):
    import subprocess

    from loadtest import drain

    stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; for i in $(seq 100); do sleep 0.1; done"])
    try:
        time.sleep(0.2)  # the trap is set
        t = Target(label="fake", url=fake.url, max_tokens=2)
        got = asyncio.run(drain.drain(t, runner.RunConfig(count=1), drain.DrainConfig(stubborn.pid, 2, 0.1, 1.0),
                                      [req(i, "[[delay=0.5]]") for i in range(2)]))
    finally:
        stubborn.kill()
        stubborn.wait()
    assert got["pass"] is False and "still ran 1 s after it" in got["detail"] and got["by_kind"] == {"ok": 2}
    assert drain._clear({"status": "connection", "refused": True})
    assert not drain._clear({"status": "connection", "refused": False})  # reset after it was sent: lost


def test_rss_baseline_is_the_first_samples_after_the_warm_up_even_after_a_gap():
    """A machine that stalled across the warm-up's end took no sample there: the baseline is the
    first samples after it, not "the run was shorter than the warm-up"."""
    rss = soak._Rss(pid=1, interval_s=1.0)
    rss.samples = [(0.0, 100.0), (50.0, 100.0), (190.0, 110.0), (191.0, 110.0), (900.0, 111.0)]
    inv = soak._rss_invariant(rss, soak.SoakConfig(rss_warmup_s=60.0, rss_max_growth_pct=5.0))
    assert inv["pass"] is True and inv["baseline_mb"] == 110.0 and inv["end_mb"] == 111.0
    rss.samples = [(0.0, 100.0), (50.0, 100.0)]
    assert soak._rss_invariant(rss, soak.SoakConfig(rss_warmup_s=60.0))["pass"] is None


def test_a_timeout_while_the_generator_itself_stalled_is_reported_not_judged():
    recs = [{"index": 0, "status": "ok", "sent_s": 1.0, "end_s": 2.0},
            {"index": 1, "status": "timeout", "sent_s": 9.0, "end_s": 140.0},  # its timer ran out in the stall
            {"index": 2, "status": "connection", "sent_s": 10.0, "end_s": 130.0},
            {"index": 3, "status": "timeout", "sent_s": 200.0, "end_s": 260.0}]  # no stall: the server's
    blocks = {"in_use": 0.0, "waited_s": 0.0}
    v = soak.verdict(recs, [], blocks, None, soak.SoakConfig(), 300.0, stalls=[(10.0, 132.5)])
    inv = v["invariants"]["every_request_ended_clearly"]
    assert inv["pass"] is False and "#3 timeout" in inv["detail"] and "#1" not in inv["detail"]
    assert "2 timed out or failed to connect while the load generator itself was stalled" in inv["detail"]
    assert v["generator_stalls_s"] == [[10.0, 132.5]]
    v = soak.verdict(recs[:3], [], blocks, None, soak.SoakConfig(), 300.0, stalls=[(10.0, 132.5)])
    assert v["invariants"]["every_request_ended_clearly"]["pass"] is True


def test_the_stall_watch_records_a_blocked_event_loop():
    async def run():
        st = soak._Stalls(tick_s=0.01)
        t0 = time.perf_counter()
        task = asyncio.ensure_future(st.watch(t0))
        await asyncio.sleep(0.05)
        time.sleep(soak.STALL_S + 0.2)  # the loop cannot run
        await asyncio.sleep(0.05)
        task.cancel()
        return st.windows
    windows = asyncio.run(run())
    assert len(windows) == 1 and windows[0][1] - windows[0][0] >= soak.STALL_S

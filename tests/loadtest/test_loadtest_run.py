"""Runs against the fake OpenAI server: records, error kinds, percentiles, goodput, server deltas,
the report, compare, and the CLI end to end."""
from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
from fake_openai import req
from pngcheck import assert_plot_with_data, colored_share

from loadtest import cli, compare, runner, stats
from loadtest.client import Target


def _run(fake, reqs, *, timeout=30.0, **kw):
    t = Target(label=kw.pop("label", "fake"), url=fake.url, max_tokens=kw.pop("max_tokens", 6),
               timeout_s=timeout, stream=kw.pop("stream", True), api=kw.pop("api", "completions"))
    cfg = runner.RunConfig(arrival="constant", rate=kw.pop("rate", 200.0), count=len(reqs), progress=False, **kw)
    return asyncio.run(runner.run(t, cfg, reqs))


def test_records_and_errors_by_kind(fake):
    reqs = [req(i, "[[delay=0.01]] hi") for i in range(10)] + [
        req(10, "[[status=429]]"), req(11, "[[status=500]]"), req(12, "[[error-after=2]]"),
        req(13, "[[drop-after=2]]"), req(14, "[[no-done]]"), req(15, "[[hang]]"), req(16, "[[status=400]]")]
    run = _run(fake, reqs, timeout=1.0)
    s = run["summary"]
    assert s["by_kind"] == {"ok": 10, "http_429": 1, "http_5xx": 1, "stream_error": 1, "connection": 1,
                            "stream_incomplete": 1, "timeout": 1, "http_4xx": 1}
    recs = {r["index"]: r for r in run["records"]}
    assert recs[10]["retry_after_s"] == 3.0 and recs[10]["http_status"] == 429
    assert s["time_to_429_s"]["n"] == 1 and s["time_to_429_s"]["max"] == recs[10]["end_s"] - recs[10]["sent_s"]
    assert recs[11]["http_status"] == 500 and "fake 500" in recs[11]["error"]
    assert recs[12]["error_code"] == 502 and recs[12]["output_tokens"] == 2
    assert "after 2 streamed tokens" in recs[13]["error"]
    assert s["by_http_status"]["200"] >= 10 and s["by_http_status"]["429"] == 1
    assert s["ok"] == 10 and s["errors"] == 7
    for r in (recs[i] for i in range(10)):
        assert r["status"] == "ok" and r["output_tokens"] == 6 and len(r["itl_s"]) == 5
        assert 0.01 <= r["ttft_s"] <= r["e2e_s"]
        assert r["sent_s"] is not None and r["end_s"] >= r["sent_s"]
    for key in ("ttft_s", "itl_s", "e2e_s", "tpot_s"):
        d = s[key]
        assert d["n"] > 0 and d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
    assert s["output_tokens"] == 60 and s["output_tokens_per_s"] > 0
    # the server's own numbers: deltas of its histograms and counters
    h = run["server"]["histograms"]
    assert h["prefill_server:queue_seconds"]["count"] >= 12
    assert h["prefill_server:prefill_seconds"]["mean"] is not None
    assert run["server"]["counters"]["prefill_server:requests_total"]["outcome=http429"] == 1
    assert "prefill_server:kv_blocks_in_use" in run["server"]["gauges_at_end"]
    b = run["breakdown"]  # the fake observes queue 1 ms and prefill = its delay (10 ms) per answered request
    assert b["source"] == "prefill_server" and b["queue_s"] == pytest.approx(0.001, abs=1e-6)
    assert b["prefill_s"] == pytest.approx(0.01 * 10 / 14, abs=1e-6)  # 14 reached the fake, 10 with a delay
    assert b["queue_s"] + b["prefill_s"] + b["to_first_token_s"] == pytest.approx(s["ttft_s"]["mean"])
    assert b["to_first_token_s"] + b["queue_s"] + b["prefill_s"] + b["decode_s"] == pytest.approx(s["e2e_s"]["mean"])
    # the client's clock, not the fake's sleeps: a busy box may deliver a late first chunk together with
    # the tokens behind it, so the decode share can be shorter than 5 * itl_s, never negative
    assert b["decode_s"] == pytest.approx(s["e2e_s"]["mean"] - s["ttft_s"]["mean"]) and b["decode_s"] >= 0


def test_non_streamed_and_chat(fake):
    run = _run(fake, [req(i, "[[delay=0.02]]") for i in range(4)], stream=False)
    for r in run["records"]:
        assert r["status"] == "ok" and r["ttft_s"] == r["e2e_s"] and r["output_tokens"] == 6 and r["itl_s"] == []
    chat = _run(fake, [req(i) for i in range(3)], api="chat")
    assert all(r["status"] == "ok" and r["output_tokens"] == 6 for r in chat["records"])
    assert "messages" in fake.bodies[-1] and fake.bodies[-1]["stream_options"] == {"include_usage": True}
    assert fake.bodies[-1]["temperature"] == 0.0 and fake.bodies[-1]["model"] == "fake-model"


def test_needle_answers_are_checked(fake):
    reqs = [req(0, "filler. The secret number of the amber vault is 1234567. more", expect="1234567"),
            req(1, "filler without it", expect="7654321")]
    s = _run(fake, reqs)["summary"]
    assert s["needle"] == {"checked": 2, "correct": 1, "accuracy": 0.5}


def test_goodput_counts_requests_meeting_both_slos():
    recs = [{"status": "ok", "ttft_s": t, "itl_s": g} for t, g in
            [(0.1, [0.01, 0.02]), (0.2, [0.05, 0.30]), (0.5, [0.01]), (0.1, [])]] + [
        {"status": "http_429", "ttft_s": None, "itl_s": []}]
    s = stats.summarize(recs, 2.0, slo_ttft_s=0.3, slo_itl_s=0.2)
    assert s["goodput"]["requests"] == 3 and s["goodput"]["rps"] == 1.5  # #2 misses the TTFT SLO
    assert s["goodput"]["share_of_ok"] == 0.75 and s["goodput"]["share_of_all"] == 0.6
    s = stats.summarize(recs, 2.0, slo_ttft_s=0.3, slo_itl_s=0.2, itl_stat="max")
    assert s["goodput"]["requests"] == 2  # #1's max gap 0.30 > 0.2 (its mean 0.175 is not)
    assert stats.summarize(recs, 2.0, slo_ttft_s=0.3, slo_itl_s=0.1)["goodput"]["requests"] == 2
    assert stats.summarize(recs, 2.0)["goodput"]["requests"] == 4  # no SLO: every ok request
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5 and stats.percentile([], 50) is None


def test_goodput_against_the_fake_server(fake):
    reqs = [req(i, "[[delay=1.0]]" if i % 3 == 0 else "[[delay=0.01]]") for i in range(9)]
    run = _run(fake, reqs, slo_ttft_s=0.5)
    fast = [r for r in run["records"] if r["ttft_s"] <= 0.5]
    assert all(r["index"] % 3 for r in fast) and fast  # the 1 s ones never meet it (a busy box may slow others)
    assert run["summary"]["goodput"]["requests"] == len(fast)
    assert run["summary"]["goodput"]["rps"] == pytest.approx(len(fast) / run["duration_s"])


def test_retries_after_retry_after(fake, monkeypatch):
    t = Target(label="fake", url=fake.url, max_tokens=2, retries=1, retry_max_wait_s=0.0)
    cfg = runner.RunConfig(arrival="constant", rate=100, count=1, progress=False)
    run = asyncio.run(runner.run(t, cfg, [req(0, "[[status=429]]")]))
    assert run["records"][0]["attempts"] == 1  # Retry-After 3 s is over the 0 s wait limit: no retry


def _doc(run, mode="run"):
    return {"tool": "loadtest", "mode": mode, "date": "2026-12-02", "command": "python -m loadtest test",
            "runs": [run] if isinstance(run, dict) else run}


def test_report_renders_pngs(fake, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: the HTML/PNG report needs it")
    from loadtest import report

    runs = [_run(fake, [req(i, f"[[delay={0.01 * (i % 4)}]]") for i in range(12)] + [req(12, "[[status=503]]")],
                 rate=r) for r in (50.0, 100.0)]
    pngs = report.write(_doc(runs, "sweep"), str(tmp_path / "r.html"))
    assert set(pngs) == {"ttft_cdf", "latency_vs_load", "breakdown", "errors"}
    for p in pngs.values():
        assert_plot_with_data(pathlib.Path(p))
    page = (tmp_path / "r.html").read_text()
    assert "r-ttft_cdf.png" in page and "TTFT p99 s" in page and "http_5xx" in page
    failed = _run(fake, [req(0, "[[status=500]]")])  # nothing to plot: the check must see it
    empty = report.write(_doc(failed), str(tmp_path / "e.html"))
    assert "latency_vs_load" not in empty and "breakdown" not in empty and colored_share(pathlib.Path(empty["ttft_cdf"])) < 0.0005


def test_compare_two_results(fake, tmp_path):
    a = _run(fake, [req(i, "[[delay=0.01]]") for i in range(5)], label="A")
    b = _run(fake, [req(i, "[[delay=0.3]]") for i in range(5)], label="B")
    (tmp_path / "a.json").write_text(json.dumps(_doc(a)))
    (tmp_path / "b.json").write_text(json.dumps(_doc(b)))
    text = compare.compare([str(tmp_path / "a.json"), str(tmp_path / "b.json")], str(tmp_path / "c.html"),
                           str(tmp_path / "c.txt"))
    header = text.splitlines()[0]
    assert "a: A" in header and "b: B" in header and "B/A" in header
    ttft = next(line for line in text.splitlines() if line.startswith("TTFT p50 s"))
    ta, tb = a["summary"]["ttft_s"]["p50"], b["summary"]["ttft_s"]["p50"]
    assert ttft.split()[-3:] == [f"{ta:.3f}", f"{tb:.3f}", f"{tb / ta:.2f}x"] and tb >= 0.3
    assert "<table>" in (tmp_path / "c.html").read_text() and (tmp_path / "c.txt").read_text() == text


def test_cli_run_sweep_baseline_compare_report(fake, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = cli.main(["run", "--url", fake.url + "/v1", "--workload", "mix", "--short-min-tokens", "10",
                   "--short-max-tokens", "20", "--long-min-tokens", "50", "--long-max-tokens", "60",
                   "--rate", "50", "--count", "8", "--max-tokens", "3", "--out", str(out), "--quiet",
                   "--baseline-url", fake.url, "--slo-ttft", "5", "--text-source", "words"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["label"] for r in doc["runs"]] == ["prefill-server", "vllm-alone"]
    assert doc["command"].startswith("python -m loadtest run --url") and doc["date"]
    assert all(r["summary"]["ok"] == 8 for r in doc["runs"])
    assert "api_key" not in doc["options"]
    sweep = tmp_path / "sweep.json"
    assert cli.main(["sweep", "--url", fake.url, "--workload", "rag", "--rag-system-tokens", "20",
                     "--rag-passage-tokens", "10", "--rates", "20,40", "--count", "4", "--out", str(sweep),
                     "--quiet", "--text-source", "words", "--arrival", "constant"]) == 0
    assert [r["config"]["rate"] for r in json.loads(sweep.read_text())["runs"]] == [20.0, 40.0]
    capsys.readouterr()
    assert cli.main(["compare", str(out), str(sweep)]) == 0
    assert "vllm-alone" in capsys.readouterr().out
    assert cli.main(["run", "--url", fake.url, "--out", str(tmp_path / "x.json"), "--quiet"]) == 2  # no bound
    if pytest.importorskip("matplotlib", reason="matplotlib is not installed: the report needs it"):
        assert cli.main(["report", str(sweep)]) == 0
        assert (tmp_path / "sweep-latency_vs_load.png").stat().st_size > 2048


def test_every_cli_option_has_help():
    p = cli.parser()
    subs = next(a for a in p._actions if a.dest == "cmd").choices
    missing = [f"{name} {a.option_strings or a.dest}" for name, sp in subs.items() for a in sp._actions
               if a.dest != "help" and not (a.help or "").strip()]
    assert missing == []


def test_the_api_key_comes_from_the_environment_and_stays_out_of_results(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFILL_SERVER_API_KEY", "sk-secret-123")
    out = tmp_path / "k.json"
    assert cli.main(["run", "--url", fake.url, "--rate", "50", "--count", "2", "--max-tokens", "2",
                     "--workload", "needle", "--doc-min-tokens", "50", "--doc-max-tokens", "80",
                     "--out", str(out), "--quiet", "--text-source", "words"]) == 0
    assert fake.auth == ["Bearer sk-secret-123"] * 2
    assert "sk-secret-123" not in out.read_text()
    assert json.loads(out.read_text())["runs"][0]["summary"]["needle"]["accuracy"] == 1.0
    for key_arg in (["--api-key", "sk-flag-456"], ["--api-key=sk-flag-456"]):  # given on the command line
        assert cli.main(["run", "--url", fake.url, "--rate", "50", "--count", "1", "--max-tokens", "2",
                         *key_arg, "--out", str(out), "--quiet", "--text-source", "words"]) == 0
        assert fake.auth[-1] == "Bearer sk-flag-456" and "sk-flag-456" not in out.read_text()


def test_breakdown_sources_and_that_its_parts_add_up():
    from loadtest import breakdown

    summary = {"ttft_s": {"mean": 0.5}, "e2e_s": {"mean": 2.0}}
    ours = {"histograms": {"prefill_server:queue_seconds": {"mean": 0.1},
                           "prefill_server:prefill_seconds": {"mean": 0.3},
                           "prefill_server:kv_transfer_seconds": {"mean": 0.7},
                           "vllm:request_prefill_time_seconds": {"mean": 9.0}}}
    b = breakdown.compute(summary, ours)
    assert (b["source"], b["queue_s"], b["prefill_s"], b["kv_transfer_s"]) == ("prefill_server", 0.1, 0.3, 0.7)
    assert b["to_first_token_s"] == pytest.approx(0.1) and b["decode_s"] == pytest.approx(1.5)
    vllm = {"histograms": {"vllm:request_queue_time_seconds": {"mean": 0.05},
                           "vllm:request_prefill_time_seconds": {"mean": 0.2}}}
    b = breakdown.compute(summary, vllm)
    assert (b["source"], b["queue_s"], b["prefill_s"], b["kv_transfer_s"]) == ("vllm", 0.05, 0.2, None)
    grpc = {**summary, "server_timings_s": {"queue_s": {"mean": 0.01}, "prefill_s": {"mean": 0.4}}}
    assert breakdown.compute(grpc, ours)["source"] == "grpc"  # per-request timings beat run-wide histograms
    b = breakdown.compute(summary, {})
    assert (b["source"], b["queue_s"], b["to_first_token_s"], b["decode_s"]) == ("client", None, 0.5, 1.5)
    assert breakdown.compute({"ttft_s": {"mean": None}, "e2e_s": {"mean": None}}, {})["decode_s"] is None


def test_the_closing_scrape_waits_for_the_server_to_count_the_last_requests():
    from fake_openai import FakeOpenAI, Served

    fake = FakeOpenAI(count_delay_s=0.15)  # counted 0.15 s after the client has its answer
    with Served(fake) as s:
        fake.url = s.url
        run = _run(fake, [req(i) for i in range(3)])
    assert run["server"]["counters"]["prefill_server:requests_total"] == {"outcome=ok": 3.0}


def test_streams_are_read_to_their_end_so_the_server_counts_them_ok():
    from fake_openai import FakeOpenAI, Served

    fake = FakeOpenAI(after_done_s=0.2)  # the body ends 0.2 s after [DONE]
    with Served(fake) as s:
        fake.url = s.url
        run = _run(fake, [req(i) for i in range(4)])
    assert run["server"]["counters"]["prefill_server:requests_total"] == {"outcome=ok": 4.0}  # none cancelled
    for r in run["records"]:  # the answer was complete at [DONE]: the tail is not latency
        assert r["status"] == "ok" and r["e2e_s"] < r["end_s"] - r["sent_s"] - 0.15

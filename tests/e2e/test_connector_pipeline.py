"""Connector mode end to end: an unmodified vLLM 0.32 decode loads OUR connector
(kv_transfer.vllm.connector, installed beside it by scripts/setup.sh) through --kv-transfer-config;
the prefill streams every layer into the decode's own blocks. The foundation's checks, in this mode.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from gateway import GatewayThread
from kv_transfer.base import Route, TransferState
from prompts import all_prompts, by_name
from test_pipeline import BF16_DECODE_ARGS, MAX_TOKENS, ask, bf16_engine_options, check_bf16, report_dir
from prefill_server.config import ConnectorConfig, EngineConfig, ServerConfig
from prefill_server.connector_config import vllm_connector_config
from prefill_server.local_vllm import VllmDecode, free_port
from prefill_server.serving.server import build_service

pytestmark = pytest.mark.e2e
SECRET = "e2e-connector-secret-0123456789"
TRANSFER_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("secret") / "secret"
    p.write_text(SECRET)
    return str(p)


def connector_vllm(model_dir, log_path, secret_file: str, dtype: str,
                   transfer_timeout_s: float = TRANSFER_TIMEOUT_S, extra_args=(),
                   transfer_mode: str | None = None, prefix_caching: bool = False) -> VllmDecode:
    from conftest import DECODE_BLOCK_SIZE

    return VllmDecode(model=str(model_dir), log_path=log_path, dtype=dtype, block_size=DECODE_BLOCK_SIZE,
                      kv_transfer_config=vllm_connector_config(secret_file, transfer_timeout_s, transfer_mode),
                      extra_args=list(extra_args), prefix_caching=prefix_caching)


def running_connector_decode(decode_model_dir, tmp_path_factory, secret_file, name: str, **options):
    """Body of a module fixture: a float32 decode with our connector, started and warmed up, its log
    in PREFILL_E2E_LOG_DIR (or a tmp dir) as vllm-{name}-decode.log. options: connector_vllm's."""
    from conftest import skip_or_fail
    from prefill_server.local_vllm import vllm_python

    if vllm_python() is None:
        skip_or_fail("no vLLM decode venv at .venv-vllm: run scripts/setup.sh")
    log_dir = os.environ.get("PREFILL_E2E_LOG_DIR")
    log_dir = tmp_path_factory.mktemp(f"vllm-{name}") if not log_dir else pathlib.Path(log_dir)
    with connector_vllm(decode_model_dir, log_dir / f"vllm-{name}-decode.log", secret_file, "float32",
                        **options) as d:
        d.completion("Warm up.", max_tokens=2)
        yield d


@pytest.fixture(scope="module")
def connector_decode(decode_model_dir, tmp_path_factory, secret_file):
    yield from running_connector_decode(decode_model_dir, tmp_path_factory, secret_file, "connector")


def connector_gateway(decode: VllmDecode, secret_file: str, dtype: str, first_token: str = "auto",
                      **engine_options) -> GatewayThread:
    opts = dict(token_budget=1024) | engine_options
    svc = build_service(EngineConfig(model=decode.model, dtype=dtype, block_size=0, kv_cache_gib=0.25, **opts),
                        ServerConfig(transfer_mode="connector", decode_urls=(decode.url,), first_token=first_token,
                                     connector=ConnectorConfig(secret_file=secret_file, register_timeout_s=30)))
    assert svc.worker.engine.pool.block_size == decode.block_size
    return GatewayThread(svc, decode.url).start()


@pytest.fixture(scope="module")
def gateway(connector_decode, secret_file):
    gw = connector_gateway(connector_decode, secret_file, "float32")
    yield gw
    gw.stop()


def decode_blocks_in_use(decode: VllmDecode) -> float:
    text = httpx.get(decode.url + "/metrics", timeout=30).text
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def wait_decode_idle(decode: VllmDecode, timeout_s: float = 60) -> float:
    deadline = time.monotonic() + timeout_s
    while (usage := decode_blocks_in_use(decode)) != 0.0 and time.monotonic() < deadline:
        time.sleep(0.5)
    return usage


def test_fp32_every_prompt_token_identical_and_nothing_left(connector_decode, gateway):
    model = connector_decode.served_model_name()
    mismatches = []
    for p in all_prompts():
        alone = ask(connector_decode.url, p, model)
        ours = ask(gateway.url, p)
        if [t for t, _ in ours] != [t for t, _ in alone]:
            mismatches.append(p.name)
    assert mismatches == [], f"connector pipeline differs from vLLM alone for {mismatches}"
    producer = gateway.service.worker.engine.producer
    assert gateway.wait_pool_empty() == 0  # (finish() frees the staging a moment after the answer)
    assert producer.num_active == 0
    assert producer.stats().released_total >= len(all_prompts())  # really streamed, every time
    assert wait_decode_idle(connector_decode) == 0.0


def test_first_token_from_prefill_then_pull_token_identical(connector_decode, secret_file):
    """--first-token prefill in connector mode: a greedy request is computed first, its first
    token is ours, and the decode (prompt + [t1]) pulls the prompt's KV through our connector;
    streamed or not, the answer is vLLM alone's, and nothing is left on either side."""
    gw = connector_gateway(connector_decode, secret_file, "float32", first_token="prefill")
    try:
        model = connector_decode.served_model_name()
        ps = sorted(all_prompts(), key=lambda p: p.approx_tokens)
        chosen = [ps[0], next(p for p in ps if p.kind == "chat"), ps[len(ps) // 2], ps[-1]]
        producer = gw.service.worker.engine.producer
        for p in chosen:
            alone = ask(connector_decode.url, p, model)
            assert [t for t, _ in ask(gw.url, p)] == [t for t, _ in alone], p.name
        p = chosen[1]
        body = {"messages": p.chat(), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=600) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        whole = httpx.post(connector_decode.url + "/v1/chat/completions", timeout=600, json={
            "model": model, "messages": p.chat(), "max_tokens": MAX_TOKENS, "temperature": 0}).json()
        assert text == whole["choices"][0]["message"]["content"]
        assert gw.wait_pool_empty() == 0 and producer.num_active == 0
        assert producer.stats().released_total >= len(chosen) + 1  # read by the decode, every time
        assert wait_decode_idle(connector_decode) == 0.0
    finally:
        gw.stop()


def test_layers_are_written_while_later_layers_compute(connector_decode, gateway):
    p = max(all_prompts(), key=lambda p: p.approx_tokens)
    producer = gateway.service.worker.engine.producer
    before = set(producer.last_layer_times)
    ask(gateway.url, p)
    deadline = time.monotonic() + 30  # the decode may answer a moment before finish() returns
    while not (new := set(producer.last_layer_times) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    times = sorted(producer.last_layer_times[new.pop()])
    L = gateway.service.info.num_layers
    assert [t[0] for t in times] == list(range(L))
    posted = {layer: t for layer, t, _ in times}
    done = {layer: t for layer, _, t in times}
    assert done[0] < posted[L - 1], "layer 0 was not on the decode before the last layer was computed"


def test_negative_control_corrupted_stream_changes_output(connector_decode, gateway):
    p = next(p for p in all_prompts() if p.kind == "plain" and p.approx_tokens >= 150)
    alone = [t for t, _ in ask(connector_decode.url, p, connector_decode.served_model_name())]
    producer = gateway.service.worker.engine.producer
    pool = gateway.service.worker.engine.pool
    layer_done = producer.layer_done

    def corrupting(request_id, layer, src_pages, ready_event=None):
        pool.kv.view(-1, *pool.kv.shape[2:])[list(src_pages)] = 0.5
        return layer_done(request_id, layer, src_pages, ready_event)

    producer.layer_done = corrupting
    try:
        ours = [t for t, _ in ask(gateway.url, p)]
    finally:
        producer.layer_done = layer_done
    assert ours != alone
    assert gateway.wait_pool_empty() == 0


def test_bad_input_and_prefill_failure_fail_cleanly(connector_decode, gateway):
    url = gateway.url
    r = httpx.post(url + "/v1/completions", json={"prompt": "", "max_tokens": 4})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi " * 9000, "max_tokens": 4})
    assert r.status_code == 400
    # the prefill fails mid-request: the decode must fail that request (not hang, not answer from
    # garbage) and keep serving
    engine = gateway.service.worker.engine
    run = engine.runner.run

    def failing(chunks):
        raise RuntimeError("injected prefill failure")

    engine.runner.run = failing
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Fail me, please.", "max_tokens": 4},
                       timeout=120)
    finally:
        engine.runner.run = run
    assert r.status_code >= 500 and "injected prefill failure" in r.text
    assert gateway.wait_pool_empty() == 0 and engine.producer.num_active == 0
    assert wait_decode_idle(connector_decode) == 0.0
    r = httpx.post(url + "/v1/completions", json={"prompt": "Still serving?", "max_tokens": 4}, timeout=120)
    assert r.status_code == 200


def test_prefill_killed_mid_transfer_fails_the_decode_request_cleanly(connector_decode, secret_file, tmp_path):
    """A separate prefill-server process is SIGKILLed while streaming: the decode's connector gives
    up after its transfer timeout, frees the request's blocks and keeps serving."""
    port = free_port()
    cmd = [sys.executable, "-m", "prefill_server.cli", "serve", "--model", connector_decode.model,
           "--dtype", "float32", "--port", str(port), "--decode-url", connector_decode.url,
           "--transfer-mode", "connector", "--secret-file", secret_file, "--kv-cache-gib", "0.25"]
    log = open(tmp_path / "prefill.log", "wb")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    try:
        line = proc.stdout.readline().decode()
        assert "listening on" in line, (tmp_path / "prefill.log").read_text()[-3000:]

        def killer():  # once the streamed forward runs (so the decode has registered)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                m = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
                if re.search(r"^prefill_server:num_requests_running 1", m, re.M):
                    break
                time.sleep(0.02)
            os.killpg(proc.pid, signal.SIGKILL)

        threading.Thread(target=killer, daemon=True).start()
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "Killed in the middle. " * 600, "max_tokens": 4}, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # the decode's request is failed by its connector after TRANSFER_TIMEOUT_S; nothing stranded
    assert wait_decode_idle(connector_decode, TRANSFER_TIMEOUT_S + 60) == 0.0
    r = httpx.post(connector_decode.url + "/v1/completions",
                   json={"model": connector_decode.served_model_name(), "prompt": "Alive?", "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 200


def test_decode_abort_mid_transfer_frees_both_sides(connector_decode, gateway):
    """The decode aborts a request while its KV streams in (its client went away): our connector
    sends Cancel, the prefill stops writing and fails the prefill, vLLM frees its blocks once the
    prefill acknowledged. Both sides end empty and keep serving."""
    from prefill_server.engine.types import PrefillRequest

    p = max(all_prompts(), key=lambda p: p.approx_tokens)
    engine = gateway.service.worker.engine
    ids = gateway.service.encode_prompt(p.text)
    fut, params = engine.start_stream(PrefillRequest("abort-me", tuple(ids), route=Route.STREAM))
    body = {"model": connector_decode.served_model_name(), "prompt": ids, "max_tokens": 4,
            "kv_transfer_params": params}
    with pytest.raises(httpx.TimeoutException):  # vLLM aborts the request when we hang up
        httpx.post(connector_decode.url + "/v1/completions", json=body, timeout=1.5)
    with pytest.raises(Exception, match="cancelled by the decode|aborted"):
        fut.result(timeout=120)
    assert gateway.wait_pool_empty(60) == 0 and engine.producer.num_active == 0
    assert wait_decode_idle(connector_decode) == 0.0
    r = httpx.post(gateway.url + "/v1/completions", json={"prompt": "Still here?", "max_tokens": 4}, timeout=120)
    assert r.status_code == 200


def test_bf16_connector_mode(decode_model_dir, tmp_path_factory, secret_file):
    log = tmp_path_factory.mktemp("vllm-connector-bf16") / "vllm-decode.log"
    # bf16 matmuls are slow on CPUs without AMX: one layer of a 3K prompt can take well over the
    # 20 s the kill test uses, on a loaded 2-core machine; keep the connector's default here.
    # Bits: our prefill mirrors the decode's kernel and schedule (test_pipeline.bf16_engine_options).
    threads = torch.get_num_threads()
    with connector_vllm(decode_model_dir, log, secret_file, "bfloat16", 120.0, BF16_DECODE_ARGS) as decode:
        decode.completion("Warm up.", max_tokens=2)
        # the first token from our prefill (computed first, then pulled): the decode's first step is
        # vLLM alone's first decode step (prefill_server/serving/first_token.py)
        gw = connector_gateway(decode, secret_file, "bfloat16", first_token="prefill", **bf16_engine_options())
        try:
            check_bf16(decode, gw, report_dir(log.parent) / "bf16_report_connector.json")
        finally:
            gw.stop()
            torch.set_num_threads(threads)


def test_decode_killed_mid_transfer_frees_the_prefill_and_it_keeps_serving(decode_model_dir, secret_file,
                                                                          tmp_path_factory):
    """A real decode's whole process group is SIGKILLed while a 3K-token prompt's layers are being
    written into it (the prefill's forward is held after queuing layer 4, so the kill lands
    mid-transfer however slow the machine): the client gets a 5xx naming the decode, the prefill's
    blocks are all back within the lease time, and the prefill keeps serving (a fresh decode on
    the same address answers exactly like vLLM alone)."""
    from conftest import skip_or_fail
    from prefill_server.local_vllm import vllm_python

    if vllm_python() is None:
        skip_or_fail("no vLLM decode venv at .venv-vllm: run scripts/setup.sh")
    log_dir = tmp_path_factory.mktemp("vllm-connector-killed")
    decode = connector_vllm(decode_model_dir, log_dir / "killed-decode.log", secret_file, "float32")
    with decode:
        decode.completion("Warm up.", max_tokens=2)
        gw = connector_gateway(decode, secret_file, "float32")
        engine, producer = gw.service.worker.engine, gw.service.worker.engine.producer
        held, go, rids = threading.Event(), threading.Event(), []
        layer_done = producer.layer_done

        def holding(request_id, layer, src_pages, ready_event=None):
            layer_done(request_id, layer, src_pages, ready_event)
            if layer == 4 and not held.is_set():
                rids.append(request_id)
                held.set()
                assert go.wait(600), "the test never let the forward go on"

        producer.layer_done = holding
        try:
            prompt = by_name("plain-GPL-3-3000").text
            answer: list[httpx.Response] = []
            client = threading.Thread(target=lambda: answer.append(httpx.post(
                gw.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=600)))
            client.start()
            assert held.wait(600), "the decode never registered, or the forward never reached layer 4"
            assert engine.pool.num_used > 0 and producer.num_active == 1
            os.killpg(decode.proc.pid, signal.SIGKILL)  # API server, engine core, worker
            decode.proc.wait()
            t_kill = time.monotonic()
            go.set()
            client.join(600)
            r = answer[0]
            assert r.status_code >= 500 and decode.url in r.text, r.text
            lease_s = producer.pull.lease_ttl_s
            assert gw.wait_pool_empty(lease_s) == 0 and producer.num_active == 0, producer.state(rids[0])
            assert time.monotonic() - t_kill <= lease_s
            assert producer.state(rids[0]) in (TransferState.ABORTED, TransferState.FAILED)
            assert httpx.get(gw.url + "/health", timeout=10).status_code == 200
            # a fresh decode on the same address: the same prefill server streams into it
            fresh = connector_vllm(decode_model_dir, log_dir / "fresh-decode.log", secret_file, "float32")
            fresh.port = decode.port
            with fresh:
                p = by_name("plain-LGPL-2.1-150")
                alone = [t for t, _ in ask(fresh.url, p, fresh.served_model_name())]
                assert [t for t, _ in ask(gw.url, p)] == alone
                assert gw.wait_pool_empty() == 0 and producer.num_active == 0
                assert wait_decode_idle(fresh) == 0.0
        finally:
            go.set()
            producer.layer_done = layer_done
            gw.stop()

"""Start-up and shutdown as a user meets them: a decode that is not up yet is waited for (bounded,
logged), one that never comes gives one clear line, --dtype auto follows the decode, SIGTERM drains
(gRPC health NOT_SERVING, in-flight requests finish) and the cleanup runs before the process exits."""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fake_decode import FakeDecode
from kv_transfer.vllm import discovery
from kv_transfer.vllm.discovery import DecodeFacts
from prefill_server.config import EngineConfig
from prefill_server.errors import DecodeUnavailable
from prefill_server.local_vllm import free_port
from prefill_server.serving.server import follow_decode

EXE = str(pathlib.Path(sys.executable).parent / "prefill-server")


def facts(**kw) -> DecodeFacts:
    return DecodeFacts(**{"url": "http://d:8100", "vllm_version": "0.32.0", "model": "/m", "served_model_name": "m",
                          **kw})


def test_dtype_auto_follows_the_decode_and_a_mismatch_names_both_fixes():
    assert follow_decode(EngineConfig(dtype="auto"), facts(dtype="float32")).dtype == "float32"
    assert follow_decode(EngineConfig(dtype="auto"), facts()).dtype == "auto"  # unknown: the model's
    assert follow_decode(EngineConfig(dtype="bfloat16"), facts(dtype="bfloat16")).dtype == "bfloat16"
    with pytest.raises(ValueError) as e:
        follow_decode(EngineConfig(dtype="bfloat16"), facts(dtype="float32"))
    assert "--dtype float32 (or auto)" in str(e.value) and "decode with --dtype bfloat16" in str(e.value)


def test_discovery_reads_the_decodes_limits():
    with FakeDecode(max_model_len=1234, model="served-name") as d:
        f = discovery.discover(d.url)
    assert (f.max_model_len, f.served_model_name, f.model, f.vllm_version) == (1234, "served-name",
                                                                              "/models/served-name", "0.32.0")


def test_a_decode_still_starting_is_waited_for():
    decode = FakeDecode()
    port = decode.server.port
    threading.Timer(1.5, decode.server.start).start()
    try:
        t0 = time.monotonic()
        f = discovery.wait_for(f"http://127.0.0.1:{port}", 20, retry_every_s=0.2)
        assert f.served_model_name == "fake" and time.monotonic() - t0 >= 1.0
    finally:
        time.sleep(0.2)
        decode.server.stop()


def test_a_decode_that_never_comes_fails_after_the_wait():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(DecodeUnavailable, match="gave up after 1 s"):
        discovery.wait_for(url, 1.0, retry_every_s=0.2)
    assert 1.0 <= time.monotonic() - t0 < 5


def test_cli_unreachable_decode_is_one_clear_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run([EXE, "serve", "--decode-url", url, "--decode-wait", "2", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and url in errors[0] and "--decode-url" in errors[0], r.stderr
    assert "decode not ready (attempt 1" in r.stderr  # each retry is logged


@pytest.mark.parametrize("args,needle", [
    (["--host", "no.such.host.invalid"], "--host no.such.host.invalid: not an address"),
    (["--port", "{busy}"], "HTTP cannot listen on 127.0.0.1:{busy} (--host, --port)"),
    (["--transfer-mode", "connector", "--decode-url", "http://127.0.0.1:9"], "shared secret of at least 16"),
    (["--token-budget", "1"], "--token-budget 1 is below the KV block size, 16 tokens"),
    (["--kv-cache-gib", "100000"], "--kv-cache-gib: the KV pool would need 100000.00 GiB"),
])
def test_cli_startup_mistakes_are_one_line_naming_the_flag(args, needle):
    """Refused at once, before any decode is waited for or the model loads where it can be, with
    one line that names the flag; no traceback."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        args = [a.replace("{busy}", port) for a in args]
        env = {k: v for k, v in os.environ.items() if k != "PREFILL_SERVER_SECRET"}
        cmd = [EXE, "serve", "--transfer-mode", "local", "--warm-up-tokens", "0", "--port", "0", *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle.replace("{busy}", port) in errors[0], r.stderr


def grpc_status(target: str) -> str:
    with grpc.insecure_channel(target) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def test_sigterm_drains_then_cleans_up(tmp_path):
    """A request in flight when SIGTERM arrives still gets its answer; gRPC health says
    NOT_SERVING from the signal on; the log says what happens; the engine and gRPC stop cleanly."""
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([EXE, "serve", "--transfer-mode", "local", "--port", "0", "--grpc-port", "0",
                             "--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "16",
                             "--token-budget", "16"],
                            stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
                            env={**os.environ, "PREFILL_SERVER_API_KEY": "k3y"})
    try:
        grpc_line = proc.stdout.readline()
        http_line = proc.stdout.readline()
        target = re.search(r"gRPC on (\S+)", grpc_line).group(1)
        url = re.search(r"listening on (http://\S+)", http_line).group(1)
        assert grpc_status(target) == "SERVING"
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 401  # key from the env
        result = {}
        slow = threading.Thread(target=lambda: result.update(r=httpx.post(
            url + "/v1/completions", json={"prompt": "the sea " * 300, "temperature": 0}, timeout=120,
            headers={"Authorization": "Bearer k3y"})))
        slow.start()
        time.sleep(1.0)  # ~600 tokens in steps of 16: still running
        assert slow.is_alive()
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while grpc_status(target) == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert grpc_status(target) in ("NOT_SERVING", "UNAVAILABLE")
        slow.join(timeout=120)
        assert result["r"].status_code == 200, result["r"].text
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "SIGTERM received: draining" in text and "stopped: engine, gRPC and decode client closed" in text, text


@pytest.mark.parametrize("how", ["drain timeout", "second SIGTERM"])
def test_a_request_the_shutdown_cuts_off_gets_a_clear_503(tmp_path, how):
    """A request still running when --drain-timeout ends, or at a second SIGTERM, is answered 503
    ServerStopping with Retry-After (not uvicorn's bare 500), and the process exits 0 without a
    traceback in its log."""
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([EXE, "serve", "--transfer-mode", "local", "--port", "0", "--dtype", "float32",
                             "--num-kv-blocks", "512", "--block-size", "16", "--token-budget", "16",
                             "--drain-timeout", "1" if how == "drain timeout" else "60"],
                            stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True)
    try:
        url = re.search(r"listening on (http://\S+)", proc.stdout.readline()).group(1)
        result = {}
        slow = threading.Thread(target=lambda: result.update(r=httpx.post(
            url + "/v1/completions", json={"prompt": "the sea " * 1500, "temperature": 0}, timeout=120)))
        slow.start()
        time.sleep(1.0)  # ~3,000 tokens in steps of 16: running for a while yet
        assert slow.is_alive()
        proc.send_signal(signal.SIGTERM)
        if how == "second SIGTERM":
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
        slow.join(timeout=60)
        r = result["r"]
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", r.text
        assert r.json()["error"]["type"] == "ServerStopping" and "retry it" in r.json()["error"]["message"]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Traceback" not in text and "stopped: engine, gRPC and decode client closed" in text, text

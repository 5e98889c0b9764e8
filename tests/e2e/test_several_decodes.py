"""Several real vLLM 0.32 decodes behind one prefill (nixl-compat, fp32): every prompt token-identical
to vLLM alone whichever decode answers, requests spread over both, and a decode SIGKILLed: the
requests it held fail clearly, the next ones go to the other decode, readiness says degraded."""
from __future__ import annotations

import os
import pathlib
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import DECODE_BLOCK_SIZE
from gateway import GatewayThread
from prompts import all_prompts
from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.local_vllm import VllmDecode
from prefill_server.serving.server import build_service
from test_pipeline import ask

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]


def prompts_seen(decode: VllmDecode) -> float:
    text = httpx.get(decode.url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def second_decode(decode_model_dir, tmp_path_factory):
    log_dir = os.environ.get("PREFILL_E2E_LOG_DIR")
    log = (pathlib.Path(log_dir) if log_dir else tmp_path_factory.mktemp("decode-b")) / "vllm-second-decode.log"
    with VllmDecode(model=str(decode_model_dir), log_path=log, dtype="float32", block_size=DECODE_BLOCK_SIZE) as d:
        d.completion("Warm up.", max_tokens=2)
        yield d


def test_two_decodes_token_identical_then_one_killed(vllm_decode, second_decode):
    a, b = vllm_decode, second_decode
    svc = build_service(EngineConfig(model=a.model, dtype="float32", kv_cache_gib=0.3),
                        ServerConfig(transfer_mode="nixl-compat", decode_urls=(a.url, b.url)))
    gw = GatewayThread(svc, [a.url, b.url], health_interval_s=1.0).start()
    try:
        seen = prompts_seen(a), prompts_seen(b)
        model = a.served_model_name()
        mismatches = [p.name for p in all_prompts() if [t for t, _ in ask(gw.url, p)] != [t for t, _ in ask(a.url, p, model)]]
        assert mismatches == [], f"differs from vLLM alone for {mismatches}"
        got_a, got_b = prompts_seen(a) - seen[0], prompts_seen(b) - seen[1]
        assert got_a >= 5 and got_b >= 5, (got_a, got_b)  # (a also answered the 22 baseline requests)
        assert gw.wait_pool_empty() == 0

        p = next(p for p in all_prompts() if p.kind == "plain")
        with ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(httpx.post, gw.url + "/v1/completions", json={
                "prompt": p.text, "max_tokens": 400, "temperature": 0, "ignore_eos": True}, timeout=300)
                for _ in range(4)]
            time.sleep(3)
            os.killpg(os.getpgid(b.proc.pid), signal.SIGKILL)
            results = [f.result() for f in futs]
        for r in results:  # each either answered whole, or failed naming the decode
            assert r.status_code == 200 or (r.status_code in (502, 503) and b.url in r.text), (r.status_code, r.text)
        deadline = time.monotonic() + 15
        while not httpx.get(gw.url + "/health").json().get("degraded"):
            assert time.monotonic() < deadline, "readiness does not say the dead decode is down"
            time.sleep(0.2)
        ready = httpx.get(gw.url + "/health")
        assert ready.status_code == 200 and b.url in ready.json()["degraded"][0]
        for q in all_prompts()[:4]:  # all go to the decode still up, and answer as vLLM alone does
            assert [t for t, _ in ask(gw.url, q)] == [t for t, _ in ask(a.url, q, model)]
        assert gw.wait_pool_empty() == 0
    finally:
        gw.stop()

"""This server in front of SGLang 0.5.23 decodes (issue 18), end to end on CPU.

SGLang's decode server has no CPU build, so the decode is ``sglang_decode.HarnessDecode``: SGLang's own
transfer classes (``NixlKVManager``, ``NixlKVReceiver`` in .venv-sglang) receive our KV into pages laid
out as SGLang's, and Hugging Face transformers decodes greedily from exactly that KV and our first
token (the aux row). So the tokens are right only if every byte we sent is. Two set-ups, each
started only through documented flags and APIs:

- our gateway with ``--decode-url`` at the decode (found to be SGLang from its ``/server_info``):
  completions (text and token ids), chat, ``/generate`` and a stream, each as HF's greedy tokens;
- the real ``sglang-router`` 0.3.2 (``--pd-disaggregation``) with ``prefill-server serve
  --decode-engine sglang`` as its prefill: the same, and a request we refuse comes back at once (its
  room failed on the decode with our reason, not after SGLang's 300 s), with the server still serving.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

import httpx
import pytest
import torch

from gateway import GatewayThread
from sglang_decode import HarnessDecode, venv_missing
from test_pd_routers import PrefillInstance, RouterProcess
from prefill_server.config import EngineConfig, ServerConfig, SGLangConfig
from prefill_server.local_vllm import free_port
from prefill_server.models.registry import resolve_model
from prefill_server.serving.server import build_service

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(venv_missing() is not None, reason=str(venv_missing()))]
PAGE = 16
MAX_TOKENS = 6
TEXT = ("The lighthouse keeper wrote in his log every evening: the wind, the ships that passed, "
        "and the colour of the sea. On the last page he wrote")


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    with HarnessDecode(resolve_model(None), tmp_path_factory.mktemp("sglang") / "harness-decode.log",
                       page_size=PAGE, pages=4096 // PAGE) as d:
        yield d


def greedy(decode: HarnessDecode, ids: list[int], n: int = MAX_TOKENS) -> list[int]:
    """HF's greedy tokens over the whole prompt (the reference the received KV must reproduce)."""
    with decode._model_lock, torch.no_grad():
        out = decode.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def chat_ids(decode: HarnessDecode, messages: list[dict]) -> list[int]:
    ids = decode.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def requests(decode: HarnessDecode, model: str, *, token_ids: bool = True) -> list[tuple[str, str, dict, list[int]]]:
    """(what, path, body, reference tokens). Token-id prompts only where the path takes them."""
    ids = decode.tokenizer.encode(TEXT)
    messages = [{"role": "user", "content": "Name three colours of the sea at dusk."}]
    out = [("text completion", "/v1/completions", {"model": model, "prompt": TEXT, "max_tokens": MAX_TOKENS,
                                                   "temperature": 0}, greedy(decode, ids)),
           ("chat", "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": MAX_TOKENS,
                                             "temperature": 0}, greedy(decode, chat_ids(decode, messages))),
           ("/generate, token ids", "/generate", {"input_ids": ids[5:], "sampling_params": {
               "max_new_tokens": MAX_TOKENS, "temperature": 0}}, greedy(decode, ids[5:]))]
    if token_ids:
        out.append(("token-id completion", "/v1/completions", {"prompt": ids[:40], "max_tokens": MAX_TOKENS,
                                                                "temperature": 0}, greedy(decode, ids[:40])))
    return out


def check_all(url: str, decode: HarnessDecode, cases) -> list:
    failures = []
    for what, path, body, want in cases:
        r = httpx.post(url + path, json=body, timeout=300)
        got = r.json().get("output_ids") if r.status_code == 200 else r.text[:300]
        if got != want:
            failures.append((what, got, want))
        elif r.json()["harness"]["first_token"] != want[0]:
            failures.append((what, "aux row", r.json()["harness"]))
    return failures


def streamed_text(url: str, body: dict) -> str:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(c["text"] for e in events for c in e["choices"])


def test_our_gateway_in_front_of_an_sglang_decode(decode):
    svc = build_service(EngineConfig(dtype="float32", kv_cache_gib=0.1),
                        ServerConfig(decode_urls=(decode.url,), sglang=SGLangConfig(bootstrap_port=free_port())))
    assert svc.backend.name == "sglang"  # --decode-engine auto: the decode's /server_info says SGLang
    gw = GatewayThread(svc, decode.url).start()
    try:
        assert check_all(gw.url, decode, requests(decode, svc.info.served_name)) == []
        body = {"prompt": TEXT, "max_tokens": MAX_TOKENS, "temperature": 0}
        assert streamed_text(gw.url, body) == decode.tokenizer.decode(greedy(decode, decode.tokenizer.encode(TEXT)),
                                                                     skip_special_tokens=True)
        rooms = [b["body"].get("bootstrap_room") for b in decode.seen[-5:]]
        assert all(isinstance(r, int) and r > 0 for r in rooms) and len(set(rooms)) == 5
        assert gw.wait_pool_empty() == 0
        assert svc.worker.engine.producer.num_active == 0
    finally:
        gw.stop()


class SGLangRouter(RouterProcess):
    """sglang-router in PD mode, ready once both workers are registered (each after its GET /health)."""

    def __init__(self, prefill: str, bootstrap_port: int, decode: str, log_path: pathlib.Path):
        def registered(url: str) -> bool:
            workers = httpx.get(url + "/workers", timeout=2).json()
            return isinstance(workers, dict) and len(workers.get("workers", [])) >= 2

        super().__init__("sglang-router", lambda port: [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill,
            str(bootstrap_port), "--decode", decode, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--policy", "round_robin"], log_path, registered, timeout_s=180)


def test_behind_the_real_sglang_router(decode, tmp_path):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e .[test])")
    bootstrap = free_port()
    prefill = PrefillInstance(str(resolve_model(None)), tmp_path / "prefill.log",
                              ["--decode-engine", "sglang", "--page-size", str(PAGE), "--bootstrap-port", str(bootstrap)])
    router = None
    try:
        info = httpx.get(prefill.url + "/server_info", timeout=10).json()
        assert (info["disaggregation_mode"], info["page_size"], info["tp_size"]) == ("prefill", PAGE, 1)
        router = SGLangRouter(prefill.url, bootstrap, decode.url, tmp_path / "router.log")
        model = httpx.get(prefill.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        # (the router itself refuses token-id prompts on /v1/completions: they go through /generate)
        assert check_all(router.url, decode, requests(decode, model, token_ids=False)) == []
        body = {"model": model, "prompt": TEXT, "max_tokens": MAX_TOKENS, "temperature": 0}
        assert streamed_text(router.url, body) == decode.tokenizer.decode(
            greedy(decode, decode.tokenizer.encode(TEXT)), skip_special_tokens=True)
        # refused here (400): its room fails on the decode at once with our reason, so the router
        # answers (with the decode's failure or our 400, whichever it reports) without SGLang's 300 s
        t0 = time.monotonic()
        r = httpx.post(router.url + "/v1/completions", json={**body, "regex": "[a-z ]+"}, timeout=300)
        assert r.status_code in (400, 500) and "'regex' changes how the first token is drawn" in r.text, r.text
        assert time.monotonic() - t0 < 30
        assert check_all(router.url, decode, requests(decode, model, token_ids=False)[:1]) == []
        assert prefill.wait_pool_empty() == 0
        assert prefill.metric('prefill_server:requests_total{outcome="ok"}') >= 5
    finally:
        if router is not None:
            router.stop()
        prefill.stop()

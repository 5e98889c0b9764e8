"""Loader details: sharded checkpoints, fused projections, tied embeddings, clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference import build_hf_model, hf_config
from prefill_server.models.reference_attention import CausalAttention
from prefill_server.models.weights import load_model


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model(hf_config("llama", kv_heads=2))


def _logits(model, n=9):
    ids = torch.arange(n) * 7 % 256
    return model(ids, torch.arange(n), CausalAttention.single(n))


def test_sharded_equals_single_file(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "single")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    _, a = load_model(tmp_path / "single")
    _, b = load_model(tmp_path / "sharded")
    torch.testing.assert_close(_logits(a), _logits(b), rtol=0, atol=0)


def test_fused_weights_and_meta_free(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    cfg, model = load_model(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    attn = model.model.layers[1].self_attn
    expect = torch.cat([sd[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(attn.qkv_proj.weight, expect)
    assert not any(p.is_meta for p in model.parameters())
    assert not cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_missing_lm_head_means_tied(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg, model = load_model(tmp_path)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_tensor_and_no_safetensors_are_clear_errors(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.0.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.mlp.up_proj.weight'"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_dtype_override(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()).get("dtype", "float32") == "float32"
    cfg, model = load_model(tmp_path, dtype="bfloat16")
    assert cfg.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert _logits(model).dtype == torch.float32

from __future__ import annotations

import json

import pytest
import torch

from prefill_server.models.config import Llama3RopeScaling, ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": [2, 3],
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama_defaults():
    cfg = ModelConfig.from_dict(BASE)
    assert cfg.architecture == "llama" and cfg.head_dim == 16 and cfg.num_kv_heads == 2
    assert cfg.dtype == torch.bfloat16 and cfg.eos_token_ids == (2, 3) and cfg.rope_theta == 10000.0
    assert cfg.rope_scaling is None and not cfg.qk_norm and not cfg.attention_bias and not cfg.tie_word_embeddings


@pytest.mark.parametrize("layout", ["transformers4", "transformers5"])
def test_llama3_rope_scaling_both_layouts(layout):
    if layout == "transformers4":
        d = {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}
    else:
        d = {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}}
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)


def test_family_flags():
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096,
                                   "use_sliding_window": False})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.architecture == "mistral" and mistral.sliding_window == 4096


def test_rejects_unknown_architecture_and_rope():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM|supported"):
        ModelConfig.from_dict({**BASE, "architectures": ["GPTNeoXForCausalLM"]})
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="missing 'low_freq_factor'"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_from_hf_dir_merges_generation_config_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_hf_dir(tmp_path).eos_token_ids == (2, 7)
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_hf_dir(tmp_path / "missing")

"""Helpers for the model tests: tiny random Hugging Face models of each family as the reference."""
from __future__ import annotations

import inspect

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def hf_config(family: str, *, vocab=256, hidden=64, inter=128, layers=2, heads=4, kv_heads=2,
              head_dim=None, tied=False, bias=False, llama3_rope=False, **extra):
    """A transformers config for a tiny model (works with the 4.x and 5.x rope config layouts)."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
              tie_word_embeddings=tied, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1,
              eos_token_id=2, **extra)
    if head_dim is not None:
        kw["head_dim"] = head_dim
    if family in ("llama", "qwen3"):
        kw["attention_bias"] = bias
    if family == "llama":
        kw["mlp_bias"] = bias
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if llama3_rope:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:
        kw["rope_parameters"] = rope
    else:  # transformers 4.x
        kw["rope_theta"] = rope.pop("rope_theta")
        kw["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    cfg = cls(**kw)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]]
    return cfg


def build_hf_model(cfg, seed: int = 0):
    """Random HF model in float32 with non-trivial norm weights and biases."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


def hf_cache_kv(out, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of ``layer`` from an HF forward with use_cache=True, as [T, Hkv, D] (batch 0)."""
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    if hasattr(cache, "layers"):
        k, v = cache.layers[layer].keys, cache.layers[layer].values
    elif hasattr(cache, "key_cache"):
        k, v = cache.key_cache[layer], cache.value_cache[layer]
    else:
        k, v = cache[layer]
    return k[0].transpose(0, 1), v[0].transpose(0, 1)

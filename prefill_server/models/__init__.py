"""Models: config, the Llama-family forward, weights loading, tokenizer, registry (default model).

    cfg, model = load_model(resolve_model(None), dtype="float32")
    logits = model(input_ids, positions, CausalAttention(cu_seqlens), logits_indices)
"""
from prefill_server.models.config import Llama3RopeScaling, ModelConfig
from prefill_server.models.llama import AttentionFn, LlamaForCausalLM
from prefill_server.models.reference_attention import CausalAttention
from prefill_server.models.registry import DEFAULT_MODEL, convert_default_model, resolve_model
from prefill_server.models.tokenizer import Tokenizer
from prefill_server.models.weights import load_model

__all__ = [
    "AttentionFn", "CausalAttention", "DEFAULT_MODEL", "Llama3RopeScaling", "LlamaForCausalLM", "ModelConfig",
    "Tokenizer", "convert_default_model", "load_model", "resolve_model",
]

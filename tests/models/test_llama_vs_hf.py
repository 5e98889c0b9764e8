"""Our Llama-family forward against transformers on tiny random models of every family:
logits and per-layer K (post-rope) / V, in float32 and bfloat16."""
from __future__ import annotations

import copy

import pytest
import torch

from hf_reference import build_hf_model, hf_cache_kv, hf_config, rel_err
from prefill_server.models.reference_attention import CausalAttention
from prefill_server.models.weights import load_model

# (id, family, config kwargs): GQA ratios 1, 2 and 4; tied and untied; the family-specific flags.
CASES = [
    ("llama-mha-llama3rope", "llama", dict(kv_heads=4, llama3_rope=True)),
    ("llama-gqa2-tied-bias", "llama", dict(kv_heads=2, tied=True, bias=True)),
    ("mistral-gqa4", "mistral", dict(kv_heads=1, sliding_window=None)),
    ("qwen2-gqa2-tied", "qwen2", dict(kv_heads=2, tied=True)),
    ("qwen3-gqa4-headdim", "qwen3", dict(kv_heads=1, hidden=48, head_dim=32)),
    ("qwen3-gqa2-tied", "qwen3", dict(kv_heads=2, tied=True, head_dim=24)),
]
T = 40


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def saved_model(request, tmp_path_factory):
    _, family, kw = request.param
    hf = build_hf_model(hf_config(family, **kw))
    path = tmp_path_factory.mktemp(request.param[0])
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_logits_and_kv_match_hf(saved_model, dtype, tol):
    hf, path = saved_model
    cfg, model = load_model(path, dtype=dtype)
    assert cfg.dtype == dtype and model.lm_head.weight.dtype == dtype
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (T,))
    with torch.no_grad():
        ref = copy.deepcopy(hf).to(dtype)(ids[None], use_cache=True)
        ref32 = hf(ids[None]).logits[0]
    attn = CausalAttention.single(T, record=True)
    logits = model(ids, torch.arange(T), attn)

    assert logits.dtype == torch.float32 and logits.shape == (T, cfg.vocab_size)
    assert rel_err(logits, ref.logits[0].float()) <= tol
    # in bf16, our distance to the fp32 truth is HF's own bf16 distance (not just "small")
    assert rel_err(logits, ref32) <= 1.5 * rel_err(ref.logits[0], ref32) + 1e-5
    for layer in range(cfg.num_layers):
        k_ref, v_ref = hf_cache_kv(ref, layer)
        assert attn.keys[layer].shape == (T, cfg.num_kv_heads, cfg.head_dim)
        assert rel_err(attn.keys[layer], k_ref) <= tol, f"K of layer {layer}"
        assert rel_err(attn.values[layer], v_ref) <= tol, f"V of layer {layer}"

    # logits_indices selects rows (and the result equals the full computation's rows)
    sel = torch.tensor([T - 1, 3])
    picked = model(ids, torch.arange(T), CausalAttention.single(T), sel)
    assert picked.shape == (2, cfg.vocab_size)
    torch.testing.assert_close(picked, logits[sel], rtol=1e-3 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)

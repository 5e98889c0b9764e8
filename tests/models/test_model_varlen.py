"""A flattened batch (several sequences concatenated, each with its own positions) gives each
sequence exactly what it gets alone; chunking the non-attention work changes nothing."""
from __future__ import annotations

import pytest
import torch

from hf_reference import build_hf_model, hf_config
from prefill_server.models.reference_attention import CausalAttention
from prefill_server.models.weights import load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-varlen")
    build_hf_model(hf_config("qwen3", kv_heads=2, head_dim=24)).save_pretrained(path)
    return load_model(path, dtype=torch.float32)[1]


def test_two_sequences_equal_separate_runs(model):
    torch.manual_seed(0)
    lens = [7, 13]
    seqs = [torch.randint(0, 256, (n,)) for n in lens]
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in lens])
    cu = [0, lens[0], sum(lens)]
    batched = CausalAttention(cu, record=True)
    logits = model(ids, positions, batched, torch.tensor([cu[1] - 1, cu[2] - 1]))
    for i, seq in enumerate(seqs):
        alone = CausalAttention.single(len(seq), record=True)
        ref = model(seq, torch.arange(len(seq)), alone, torch.tensor([len(seq) - 1]))
        torch.testing.assert_close(logits[i:i + 1], ref, rtol=1e-5, atol=1e-5)
        for layer in alone.keys:
            torch.testing.assert_close(batched.keys[layer][cu[i]:cu[i + 1]], alone.keys[layer])
            torch.testing.assert_close(batched.values[layer][cu[i]:cu[i + 1]], alone.values[layer])


def test_chunked_layers_match_unchunked(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (37,))
    full = model(ids, torch.arange(37), CausalAttention.single(37))
    model.chunk_tokens = 8
    try:
        chunked = model(ids, torch.arange(37), CausalAttention.single(37))
    finally:
        from prefill_server.models.llama import DEFAULT_CHUNK_TOKENS
        model.chunk_tokens = DEFAULT_CHUNK_TOKENS
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)


def test_sliding_window_reference():
    """The reference attention's window: query i sees keys i-w+1..i (HF Mistral's convention)."""
    torch.manual_seed(2)
    q, k, v = torch.randn(6, 2, 8), torch.randn(6, 1, 8), torch.randn(6, 1, 8)
    o = CausalAttention.single(6, sliding_window=2)(0, q, k, v)
    # the last query attends to keys 4 and 5 only
    s = (q[5] @ k[4:6, 0].T) / 8 ** 0.5  # [2 heads, 2 keys]
    expect = torch.softmax(s, -1) @ v[4:6, 0]
    torch.testing.assert_close(o[5], expect)

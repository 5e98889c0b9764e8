"""Page layouts (kv_transfer.layout): recognising vLLM 0.32's layouts from the cache views,
descriptors per layout, and the in-place conversion of [H, N, C] pages into [N, H, C] ones."""
import numpy as np
import pytest
import torch

from kv_transfer import layout
from decode_side import ORDER, Views, strides

L, NB, H, N, D = 2, 5, 3, 16, 8


def test_views_match_vllm_strides():
    # vllm 0.32 compute_layout_strides(FullAttentionSpec(block_size=16, num_kv_heads=3,
    # head_size=8, float32), num_blocks=5, num_layers=2, layout): byte strides of [L, B, H, N, C]
    vllm = {"LBHNC": (15360, 3072, 1024, 64, 1), "LBNHC": (15360, 3072, 64, 192, 1),
            "LHBNC": (15360, 1024, 5120, 64, 1), "BLHNC": (3072, 6144, 1024, 64, 1),
            "BLNHC": (3072, 6144, 64, 192, 1), "BHLNC": (1024, 6144, 2048, 64, 1)}
    for name, want in vllm.items():
        got = tuple(s * 4 for s in strides(name, L, NB, H, N, 2 * D))
        assert got[:4] == want[:4], name


@pytest.mark.parametrize("name", sorted(ORDER))
def test_describe_recognises_each_layout(name):
    v = Views(name, L, NB, H, N, D)
    a = layout.describe(v.caches)
    assert a.layout == name and layout.check(a) is None
    assert a.layer_addrs == tuple(c.data_ptr() for c in v.caches)
    assert a.page_bytes == H * N * 2 * D * 4
    assert layout.describe(v.caches, name).layout == name
    assert layout.needs_conversion(a) == (name in ("LBNHC", "BLNHC"))


def test_describe_refuses_what_is_no_layout():
    v = Views("LBHNC", L, NB, H, N, D)
    with pytest.raises(ValueError, match="vLLM says"):
        layout.describe(v.caches, "LBNHC")
    odd = [c.transpose(2, 3).contiguous().transpose(2, 3)[..., ::1] for c in v.caches]  # C not innermost
    with pytest.raises(ValueError, match="contiguous"):
        layout.describe(odd)
    with pytest.raises(ValueError, match="unknown KV page layout"):
        layout.canonical("XYZ")
    assert layout.canonical("HND") == "LBHNC" and layout.canonical("NHD") == "LBNHC"


def test_chunks_and_descriptors_per_layout():
    row = 2 * D * 4
    dense = layout.describe(Views("LBHNC", L, NB, H, N, D).caches)
    assert layout.page_chunks(dense).tolist() == [[0, 0, H * N * row]]
    split = layout.describe(Views("LHBNC", L, NB, H, N, D).caches)  # heads NB * N rows apart
    assert layout.page_chunks(split).tolist() == [[h * N * row, h * NB * N * row, N * row] for h in range(H)]
    # dense pages: runs contiguous on both sides coalesce
    pb = dense.page_bytes
    s, d = layout.descs(np.array([0, pb, 2 * pb, 9 * pb]), np.array([pb, 2 * pb, 7 * pb, 8 * pb]),
                        layout.page_chunks(dense), 0, 1)
    assert s.tolist() == [[0, 2 * pb, 0], [2 * pb, pb, 0], [9 * pb, pb, 0]]
    assert d.tolist() == [[pb, 2 * pb, 1], [7 * pb, pb, 1], [8 * pb, pb, 1]]
    # head-split pages: one descriptor per head and page (no side is contiguous across them)
    s, d = layout.descs(np.array([0, pb]), np.array([0, N * row]), layout.page_chunks(split), 0, 0)
    assert len(s) == 2 * H and s[:, 1].sum() == 2 * pb
    assert d[:H, 0].tolist() == [h * NB * N * row for h in range(H)]


@pytest.mark.parametrize("name", ["LBNHC", "BLNHC"])
def test_convert_received_turns_hnc_bytes_into_the_layout(name):
    v = Views(name, L, NB, H, N, D)
    pages = torch.randn(2, H, N, 2 * D)  # what arrives: our [H, N, C] pages, raw bytes
    a = layout.describe(v.caches)
    blocks = [3, 1]
    for layer in range(L):  # land the bytes as a WRITE would: one page span per block
        for i, b in enumerate(blocks):
            start = (a.layer_addrs[layer] - v.raw.data_ptr()) // 4 + b * a.block_stride // 4
            v.raw[start: start + H * N * 2 * D] = pages[i].reshape(-1)
    for cache in v.caches:
        layout.convert_received(cache, blocks)
    for layer in range(L):
        k, val = v.read_raw(layer, blocks, 2 * N)
        want = pages.permute(0, 2, 1, 3).reshape(2 * N, H, 2 * D)  # token-major
        torch.testing.assert_close(k, want[..., :D], rtol=0, atol=0)
        torch.testing.assert_close(val, want[..., D:], rtol=0, atol=0)
        fk, _ = v.read_like_flash_attn(layer, blocks, 2 * N)
        torch.testing.assert_close(fk, want[..., :D], rtol=0, atol=0)
    untouched = [0, 2, 4]
    assert all(float(c[untouched].abs().sum()) == 0 for c in v.caches)

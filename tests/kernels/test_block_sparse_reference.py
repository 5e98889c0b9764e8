"""Plain-torch parts of block-sparse attention: layout, mask <-> indices, reference attention and
reference estimator, config validation, the CPU plan/run path. No Triton needed."""
import dataclasses
import math

import pytest
import torch

from bsa_testlib import batch, brute_force, rel_l2
from prefill_server.kernels.block_sparse import reference as ref
from prefill_server.kernels.block_sparse.api import (SparseConfig, indices_to_mask, mask_to_indices,
                                                     plan, plan_from_mask)
from prefill_server.kernels.block_sparse.layout import build_layout, slot_geometry

CASES = [  # (q_lens, k_lens): odd lengths, varlen, q_len < k_len, single partial block
    ([77], [77]),
    ([50, 128, 5], [200, 128, 37]),
    ([33, 1], [97, 64]),
]


@pytest.mark.parametrize("q_lens,k_lens", CASES)
def test_layout_slots(q_lens, k_lens):
    bs = 32
    *_, cu_q, cu_k = batch(q_lens, k_lens, 2, 1, 16, bs)
    lay = build_layout(cu_q, cu_k, sum(q_lens), sum(k_lens), bs)
    want = [(b, j) for b, n in enumerate(q_lens) for j in range(-(-n // bs))]
    got = [(int(s), int(j)) for s, j in zip(lay.slot_seq, lay.slot_qblk) if s >= 0]
    assert got == want
    assert all(int(s) == -1 for s in lay.slot_seq[len(want):])
    lo, hi, valid = slot_geometry(lay)
    for i, (b, j) in enumerate(want):
        a = k_lens[b] - q_lens[b] + j * bs
        assert int(lo[i]) == a // bs and int(hi[i]) == (min(a + bs, k_lens[b]) - 1) // bs


def test_mask_indices_roundtrip():
    bs = 16
    *_, cu_q, cu_k = batch([70, 40], [150, 40], 4, 2, 16, bs)
    lay = build_layout(cu_q, cu_k, 110, 190, bs)
    sel = torch.rand(lay.n_slots, 2, lay.max_kblocks, generator=torch.Generator().manual_seed(1)) < 0.5
    idx, cnt = mask_to_indices(sel, lay)
    lo, _, valid = slot_geometry(lay)
    col = torch.arange(lay.max_kblocks)
    want = sel & (col < lo[:, None, None]) & valid[:, None, None]
    assert torch.equal(indices_to_mask(idx, cnt), want)
    for s in range(lay.n_slots):  # ascending, within the selectable range
        for h in range(2):
            row = idx[s, h, :cnt[s, h]]
            assert torch.all(row[1:] > row[:-1]) and torch.all(row < lo[s])


@pytest.mark.parametrize("q_lens,k_lens", CASES)
def test_reference_dense_matches_sdpa(q_lens, k_lens):
    q, k, v, cu_q, cu_k = batch(q_lens, k_lens, 4, 2, 16, 32)
    lay = build_layout(cu_q, cu_k, q.shape[0], k.shape[0], 32)
    out, lse = ref.dense_attention(q, k, v, lay)
    for b in range(len(q_lens)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        qs = q[q0:q1].transpose(0, 1)
        ks = k[k0:k1].repeat_interleave(2, 1).transpose(0, 1)
        vs = v[k0:k1].repeat_interleave(2, 1).transpose(0, 1)
        m = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(int(k1 - k0 - (q1 - q0)))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=m).transpose(0, 1)
        assert rel_l2(out[q0:q1], o) < 1e-5
        s = torch.einsum("hqd,hkd->hqk", qs, ks) / math.sqrt(16)
        l = torch.logsumexp(s.masked_fill(~m, float("-inf")), -1).T
        assert torch.allclose(lse[q0:q1], l, atol=1e-4)


@pytest.mark.parametrize("q_lens,k_lens", CASES)
def test_reference_sparse_matches_brute_force(q_lens, k_lens):
    bs = 16
    q, k, v, cu_q, cu_k = batch(q_lens, k_lens, 6, 2, 16, bs, seed=3)
    lay = build_layout(cu_q, cu_k, q.shape[0], k.shape[0], bs)
    sel = torch.rand(lay.n_slots, 2, lay.max_kblocks, generator=torch.Generator().manual_seed(2)) < 0.3
    out, lse = ref.attention(q, k, v, lay, sel)
    o2, l2 = brute_force(q, k, v, cu_q, cu_k, sel, bs)
    assert rel_l2(out, o2) < 1e-5
    assert torch.allclose(lse.double(), l2, atol=1e-4)


def test_reference_estimator_invariants():
    bs = 16
    q_lens, k_lens = [200, 64], [300, 64]
    q, k, v, cu_q, cu_k = batch(q_lens, k_lens, 4, 2, 32, bs, structured_data=True)
    lay = build_layout(cu_q, cu_k, q.shape[0], k.shape[0], bs)
    cfg = SparseConfig(block_size=bs, q_pool=4, threshold=0.3, sink_blocks=2, local_blocks=1,
                       last_q_blocks=2, probe_queries=16, probe_threshold=0.5, dense_len_threshold=100)
    sel = ref.estimate(q, k, lay, cfg)
    lo, hi, valid = slot_geometry(lay)
    nqb0 = -(-200 // bs)
    for s in range(nqb0):  # sequence 0 (300 keys >= dense_len_threshold): sparse
        d = int(lo[s])
        row = sel[s, :, :d]
        assert not sel[s, :, d:].any()
        assert row[:, :min(2, d)].all() and row[:, max(d - 1, 0):d].all()  # sinks, local
        if s >= nqb0 - 2:
            assert row.all()  # last query blocks dense
    # sequence 1 has 64 keys < dense_len_threshold: every selectable block kept
    for s in range(nqb0, nqb0 + 4):
        assert sel[s, :, :int(lo[s])].all()
    dens = ref.density(sel, lay)
    assert 0.2 < dens < 0.95, dens  # the threshold does cut


def test_estimator_threshold_monotone_and_group_shared():
    bs = 16
    q, k, v, cu_q, cu_k = batch([256], [256], 8, 2, 32, bs, structured_data=True, seed=5)
    lay = build_layout(cu_q, cu_k, 256, 256, bs)
    base = dict(block_size=bs, q_pool=8, sink_blocks=0, local_blocks=0, last_q_blocks=0,
                probe_queries=0, dense_len_threshold=0)
    dens = [ref.density(ref.estimate(q, k, lay, SparseConfig(threshold=t, **base)), lay)
            for t in (0.0, 0.05, 0.3, 1.0)]
    assert dens[0] == 1.0 and dens[0] >= dens[1] >= dens[2] >= dens[3]
    assert dens[2] < 0.8
    # one selection per KV head: the mask has Hkv rows, not Hq
    assert ref.estimate(q, k, lay, SparseConfig(threshold=0.3, **base)).shape[1] == 2


def test_probe_catches_a_single_column():
    """A lone key that the last queries attend to, diluted by pooling, is kept by the probe."""
    bs, d = 16, 32
    gen = torch.Generator().manual_seed(0)
    n = 512
    c = torch.randn(n // bs, 1, 1, d, generator=gen)
    k = (torch.randn(n // bs, bs, 1, d, generator=gen) * 0.1 + c).reshape(n, 1, d)
    q = torch.randn(n, 2, d, generator=gen) * 0.1 + 3 * c[3, 0]  # every query block looks at block 3
    needle = torch.randn(d, generator=gen)
    k[100, 0] = needle * 4
    q[-40:, :] = needle * 4  # the last queries look for the needle
    cu = torch.tensor([0, n], dtype=torch.int32)
    lay = build_layout(cu, cu, n, n, bs)
    base = dict(block_size=bs, q_pool=16, sink_blocks=0, local_blocks=0, last_q_blocks=0,
                dense_len_threshold=0, threshold=0.9)
    with_probe = ref.estimate(q, k, lay, SparseConfig(probe_queries=64, probe_threshold=0.1, **base))
    without = ref.estimate(q, k, lay, SparseConfig(probe_queries=0, **base))
    s = 20  # a query block far from the needle that is not a probe query
    assert with_probe[s, 0, 100 // bs] and not without[s, 0, 100 // bs]


def test_config_validation():
    with pytest.raises(ValueError, match="block_size"):
        SparseConfig(block_size=100)
    with pytest.raises(ValueError, match="q_pool"):
        SparseConfig(q_pool=3)
    with pytest.raises(ValueError, match="threshold"):
        SparseConfig(threshold=2.0)
    with pytest.raises(ValueError, match="backend"):
        SparseConfig(backend="cuda")


def test_plan_run_torch_backend():
    bs = 16
    q, k, v, cu_q, cu_k = batch([100, 30], [180, 30], 4, 2, 16, bs, structured_data=True)
    cfg = SparseConfig(block_size=bs, q_pool=4, threshold=0.2, dense_len_threshold=64, backend="torch")
    p = plan(q, k, cu_q, cu_k, cfg)
    assert not p.dense and 0 < p.density() <= 1
    out = torch.full_like(q, float("nan"))
    o, lse = p.run(q, k, v, out=out)
    o2, l2 = brute_force(q, k, v, cu_q, cu_k, p.block_mask, bs)
    assert o is out and not torch.isnan(o).any() and rel_l2(o, o2) < 1e-5
    # dense fallbacks: first layer(s), short batches
    assert plan(q, k, cu_q, cu_k, cfg, layer=0).dense
    assert not plan(q, k, cu_q, cu_k, cfg, layer=1).dense
    p_short = plan(q, k, cu_q, cu_k, SparseConfig(block_size=bs, q_pool=4, dense_len_threshold=10_000))
    assert p_short.dense and p_short.density() == 1.0
    o3, _ = p_short.run(q, k, v)
    assert rel_l2(o3, ref.dense_attention(q, k, v, p_short.layout)[0]) < 1e-6
    pm = plan_from_mask(p.block_mask, p.layout, cfg)
    assert torch.equal(pm.idx, p.idx) and torch.equal(pm.cnt, p.cnt)


def test_first_layers_dense_only_up_to_max_len():
    c = SparseConfig(dense_len_threshold=100, dense_first_layers=2, dense_first_layers_max_len=1000)
    assert [c.first_dense_layers(n) for n in (100, 1000, 1001, None)] == [2, 2, 0, 2]
    assert c.dense_for(1, 1000) and not c.dense_for(2, 1000)  # up to the length: the first 2 layers
    assert not c.dense_for(0, 1001) and not c.dense_for(1, 1001)  # longer: every layer sparse
    assert c.dense_for(0, 99) and c.dense_for(5, 99) and c.dense_for(None, 99)  # short: all dense
    assert c.dense_for(1, None) and not c.dense_for(2, None) and not c.dense_for(None, 1001)
    d = SparseConfig()  # defaults: a dense layer 0 up to 256K keys (128K bar), sparse at 1M (1M bar)
    assert d.first_dense_layers(131072) == d.first_dense_layers(262144) == 1
    assert d.first_dense_layers(262145) == d.first_dense_layers(1 << 20) == 0
    with pytest.raises(ValueError, match="dense_first_layers_max_len"):
        SparseConfig(dense_first_layers_max_len=-1)


def test_plan_first_layer_sparse_above_max_len():
    bs = 16
    q, k, v, cu_q, cu_k = batch([100], [180], 4, 2, 16, bs, structured_data=True)
    cfg = SparseConfig(block_size=bs, q_pool=4, threshold=0.2, dense_len_threshold=64, backend="torch",
                       dense_first_layers_max_len=180)
    assert plan(q, k, cu_q, cu_k, cfg, layer=0).dense  # 180 keys <= 180: layer 0 dense as before
    cfg = dataclasses.replace(cfg, dense_first_layers_max_len=179)
    p0, p1 = (plan(q, k, cu_q, cu_k, cfg, layer=i) for i in (0, 1))
    assert not p0.dense and torch.equal(p0.block_mask, p1.block_mask)  # the same selection as layer 1
    o, _ = p0.run(q, k, v)
    assert rel_l2(o, brute_force(q, k, v, cu_q, cu_k, p0.block_mask, bs)[0]) < 1e-5
    # a packed batch of several sequences keeps the first layers dense (longest one unknown on the host)
    q, k, v, cu_q, cu_k = batch([100, 30], [180, 30], 4, 2, 16, bs, structured_data=True)
    assert plan(q, k, cu_q, cu_k, cfg, layer=0).dense and not plan(q, k, cu_q, cu_k, cfg, layer=1).dense


def test_plan_rejects_bad_shapes():
    q, k, v, cu_q, cu_k = batch([40], [40], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="multiple"):
        plan(q[:, :3], k, cu_q, cu_k)
    with pytest.raises(ValueError, match="int32"):
        plan(q, k, cu_q.long(), cu_k)
    with pytest.raises(ValueError, match="q_len"):  # the torch path checks q_len <= k_len
        plan(q[:20], k[:10], torch.tensor([0, 20], dtype=torch.int32),
             torch.tensor([0, 10], dtype=torch.int32),
             SparseConfig(block_size=16, q_pool=4, dense_len_threshold=0, backend="torch"))

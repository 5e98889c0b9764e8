"""FP8 scores in a step's attention (``engine.runner.PagedAttention`` with FP8 pages): one kernel
launch over the step's packed prompts with q and k as e4m3 codes, against per-prompt causal
attention of the dequantized codes; and the steps that must keep the model dtype. On CPU through
Triton's interpreter (fp16), on a GPU in bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.runner import PagedAttention, _SeqSlice, fp8_scores_wanted
from prefill_server.layers.fp8 import to_e4m3

HQ, HKV, D, BS = 8, 2, 64, 16


def slices_of(lens: list[int], start: int = 0) -> list[_SeqSlice]:
    out, t, nb = [], 0, 0
    for n in lens:
        need = -(-(start + n) // BS)
        out.append(_SeqSlice(t, t + n, start, start + n, list(range(nb, nb + need))))
        t, nb = t + n, nb + need
    return out


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_a_step_of_whole_prompts_attends_on_fp8_codes(triton_device):
    dt = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    lens = [70, 33, 130]
    pool = KVPool(2, 32, HKV, BS, D, dt, device=triton_device, cache_dtype="fp8")
    slices = slices_of(lens)
    attn = PagedAttention(pool, slices, D ** -0.5, fp8_scores=True)
    assert attn.fp8_scores(1) == (1.0, pool.format.k_scale)
    g = torch.Generator().manual_seed(0)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, D, generator=g).to(dt) for h in (HQ, HKV, HKV))
    q8, k8 = to_e4m3(q), to_e4m3(k)  # what fused.rope_qkv writes (q_scale = k_scale = 1.0)
    dev = triton_device
    o = attn(1, q8.to(dev), k.to(dev), v.to(dev), k8=k8.to(dev))
    assert o.shape == (t, HQ, D) and o.dtype == dt and not torch.isnan(o).any()
    for s in slices:
        qs, ks, vs = (x[s.q_start:s.q_end].float().transpose(0, 1)[None] for x in (q8, k8, v))
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=D ** -0.5, enable_gqa=True)
        assert rel_l2(o[s.q_start:s.q_end].cpu(), ref[0].transpose(0, 1)) < 1e-2
        full = F.scaled_dot_product_attention(*(x[s.q_start:s.q_end].float().transpose(0, 1)[None]
                                                for x in (q, k, v)), is_causal=True, scale=D ** -0.5,
                                              enable_gqa=True)
        assert rel_l2(o[s.q_start:s.q_end].cpu(), full[0].transpose(0, 1)) < 0.06  # e4m3's 3 mantissa bits
        # the pages hold what the decode reads: k's and v's FP8 codes, whatever the scores were
        pk, pv = pool.read(1, s.block_ids, s.end)
        fmt = pool.format
        assert torch.equal(pk.cpu(), fmt.load(fmt.store(k[s.q_start:s.q_end], fmt.k_scale), fmt.k_scale))
        assert torch.equal(pv.cpu(), fmt.load(fmt.store(v[s.q_start:s.q_end], fmt.v_scale), fmt.v_scale))


def test_a_prompt_alone_takes_fp8_scores_in_its_sparse_layers(triton_device):
    """Sparse attention with FP8 scores: the estimator reads q's codes as its values (scale 1.0), the
    kernel computes on the codes; the same as planning and running on the dequantized values."""
    from prefill_server.kernels.block_sparse import SparseConfig, plan
    from prefill_server.layers.sparse import SparseAttention
    dt = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    n, dev = 600, triton_device
    cfg = SparseConfig(block_size=32, q_pool=16, dense_len_threshold=64, dense_first_layers=0, probe_queries=0,
                       local_blocks=1, threshold=1.0, backend="triton")  # (random data: a high bar to skip)
    pool = KVPool(2, 64, HKV, BS, D, dt, device=dev)
    (s,) = slices = slices_of([n])
    attn = PagedAttention(pool, slices, D ** -0.5, SparseAttention(cfg), fp8_scores=True)
    assert attn.fp8_scores(1) == (1.0, 1.0)  # a prompt alone: its sparse layers too
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, D, generator=g).to(dt).to(dev) for h in (HQ, HKV, HKV))
    q8, k8 = to_e4m3(q), to_e4m3(k)
    o = attn(1, q8, k, v, k8=k8)
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    p = plan(q8.to(dt), k, cu, cu, cfg, layer=1, scale=D ** -0.5)
    assert not p.dense and p.density() < 0.9  # some blocks skipped: the sparse path ran
    ref = p.run(q8.to(dt), k8.to(dt), v)[0]
    assert rel_l2(o, ref) < 1e-2
    pk, _ = pool.read(1, s.block_ids, n)
    assert torch.equal(pk, k)  # bf16 pages (--fp8-attention on): the values themselves


@pytest.mark.parametrize("cache_dtype", ["fp8", "auto"])
def test_a_step_with_a_later_chunk_attends_on_fp8_codes(triton_device, cache_dtype):
    """A whole prompt and a later chunk of another in one step: the chunk's queries attend to its
    prompt's keys [0, end) read back from the pool as codes (FP8 pages' bytes, or the codes of
    bf16 pages: --fp8-attention on), bottom-right causal."""
    dt = torch.bfloat16 if triton_device.type == "cuda" else torch.float16
    dev = triton_device
    pool = KVPool(2, 32, HKV, BS, D, dt, device=dev, cache_dtype=cache_dtype)
    g = torch.Generator().manual_seed(2)
    earlier = [torch.randn(64, HKV, D, generator=g).to(dt).to(dev) for _ in range(2)]  # prompt 2's first chunk
    whole = _SeqSlice(0, 40, 0, 40, list(range(0, 3)))
    later = _SeqSlice(40, 90, 64, 114, list(range(3, 11)))
    b, o = pool.slot_mapping(later.block_ids, 0, 64)
    pool.write(1, b, o, *earlier)
    attn = PagedAttention(pool, [whole, later], D ** -0.5, fp8_scores=True)
    assert attn.fp8_scores(1) == (1.0, pool.format.k_scale)
    q, k, v = (torch.randn(90, h, D, generator=g).to(dt).to(dev) for h in (HQ, HKV, HKV))
    q8, k8 = to_e4m3(q), to_e4m3(k)
    out = attn(1, q8, k, v, k8=k8)
    assert out.shape == (90, HQ, D) and not torch.isnan(out).any()
    fmt = pool.format

    def as_read(x):  # what the pool gives back for K / V written in the model dtype
        return fmt.load(fmt.store(x, 1.0), 1.0)
    cases = ((whole, q8[:40], k8[:40].float(), v[:40].float()),
             (later, q8[40:], torch.cat([as_read(earlier[0]), as_read(k[40:])]).float(),
              torch.cat([as_read(earlier[1]), as_read(v[40:])]).float()))
    for s, qs, ks, vs in cases:
        ks = to_e4m3(ks).float()  # (e4m3 values: their codes are themselves)
        nq, nk = qs.shape[0], ks.shape[0]
        allowed = torch.arange(nk, device=dev)[None, :] <= torch.arange(nq, device=dev)[:, None] + (nk - nq)
        ref = F.scaled_dot_product_attention(qs.float().transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                             vs.transpose(0, 1)[None], attn_mask=allowed, scale=D ** -0.5,
                                             enable_gqa=True)[0].transpose(0, 1)
        assert rel_l2(out[s.q_start:s.q_end].cpu(), ref.cpu()) < 1e-2


class _SparseFrom:
    """Sparse attention's ``wants`` as ``SparseAttention`` answers it: past a length."""

    def __init__(self, min_len: int):
        self.min_len = min_len

    def wants(self, layer: int, num_keys: int) -> bool:
        return num_keys >= self.min_len


def test_steps_that_keep_the_model_dtype():
    pool = KVPool(2, 32, HKV, BS, D, torch.float16, device="cpu", cache_dtype="fp8")
    assert PagedAttention(pool, slices_of([40]), 0.1, fp8_scores=False).fp8_scores(0) is None
    # a later chunk takes them in dense layers only (its keys read back from the pool)
    assert PagedAttention(pool, slices_of([40], start=32), 0.1, fp8_scores=True).fp8_scores(0) == (1.0, 1.0)
    assert PagedAttention(pool, slices_of([40], start=80), 0.1, _SparseFrom(100), fp8_scores=True).fp8_scores(0) is None
    # a layer that sparse attention takes keeps its own path; shorter prompts' layers take FP8 scores
    assert PagedAttention(pool, slices_of([40, 200]), 0.1, _SparseFrom(100), fp8_scores=True).fp8_scores(0) is None
    assert PagedAttention(pool, slices_of([40, 60]), 0.1, _SparseFrom(100), fp8_scores=True).fp8_scores(0) == (1.0, 1.0)
    # never on the CPU; auto: only with FP8 pages (vLLM's behaviour), on: with any pages
    assert not any(fp8_scores_wanted(w, pool, D) for w in ("auto", "on", "off"))
    if torch.cuda.is_available():
        bf16 = KVPool(2, 32, HKV, BS, D, torch.bfloat16, device="cuda")
        assert not fp8_scores_wanted("auto", bf16, D) and not fp8_scores_wanted("off", bf16, D)


@pytest.mark.gpu
def test_fp8_scores_on_a_gpu_with_fp8_pages():
    pool = KVPool(2, 32, HKV, BS, D, torch.bfloat16, device="cuda", cache_dtype="fp8")
    bf16 = KVPool(2, 32, HKV, BS, D, torch.bfloat16, device="cuda")
    fp8_cores = torch.cuda.get_device_capability() >= (8, 9)
    assert fp8_scores_wanted("auto", pool, D) == fp8_cores and fp8_scores_wanted("on", bf16, D) == fp8_cores
    assert not fp8_scores_wanted("auto", pool, 48)  # not a power of two

"""FP8 linear layers (layers/fp8.py) against plain PyTorch: the quantization's definition, the
emulated GEMM, a model's projections replaced, and (on a GPU) the Triton pass and torch._scaled_mm
against the emulation."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from prefill_server.config import EngineConfig
from prefill_server.layers import fp8
from prefill_server.layers.linear import Linear, MergedLinear
from prefill_server.bench.common import model_config
from prefill_server.models.llama import LlamaForCausalLM


def rand(*shape, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def test_rows_scale_by_their_amax_and_round_trip_within_e4m3_precision():
    x = rand(64, 256) * torch.logspace(-3, 3, 64)[:, None]  # rows six decades apart
    q, s = fp8.quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1) and s.dtype == torch.float32
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) * fp8.INV_FP8_MAX)
    assert q.float().abs().amax(-1).eq(fp8.FP8_MAX).all()  # each row's largest value hits the top code
    back = q.float() * s
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal codes; subnormals are absolute
    err = (back - x).abs()
    assert (err <= x.abs() * 2 ** -4 + s * 2 ** -9).all()


def test_a_zero_row_quantizes_to_zeros_without_nan():
    x = torch.zeros(3, 32)
    x[1] = 1.0
    q, s = fp8.quantize_rows_reference(x)
    assert torch.isfinite(s).all() and s[0, 0] == fp8.MIN_SCALE
    assert q[0].float().eq(0).all() and q[1].float().eq(fp8.FP8_MAX).all()


def test_emulated_linear_is_dequantized_activations_times_dequantized_weights():
    lin = Linear(128, 64, bias=True)
    with torch.no_grad():
        lin.weight.copy_(rand(64, 128, seed=1) * 0.05)
        lin.bias.copy_(rand(64, seed=2))
    f = fp8.Fp8Linear.from_linear(lin)
    x = rand(10, 128, seed=3)
    xq, xs = fp8.quantize_rows_reference(x)
    wq, ws = fp8.quantize_rows_reference(lin.weight.detach())
    want = (xq.float() * xs) @ (wq.float() * ws).t() + lin.bias.detach()
    torch.testing.assert_close(f(x), want, rtol=0, atol=1e-5)
    # and near the float32 layer: a few percent, e4m3's rounding of both operands
    ref = lin(x)
    assert ((f(x) - ref).norm() / ref.norm()) < 0.05


def test_merged_projection_keeps_its_split_and_forward_add_writes_where_asked():
    lin = MergedLinear(64, [32, 16, 16], bias=False)
    with torch.no_grad():
        lin.weight.copy_(rand(64, 64, seed=4) * 0.1)
    f = fp8.Fp8Linear.from_linear(lin)
    parts = f.forward_split(rand(5, 64, seed=5))
    assert [p.shape[-1] for p in parts] == [32, 16, 16]
    x, res = rand(5, 64, seed=6), rand(5, 64, seed=7)
    want = res + f(x)
    torch.testing.assert_close(f.forward_add(x, res), want)
    out = torch.empty_like(res)
    assert f.forward_add(x, res, out=out) is out and torch.equal(out, want)
    r2 = res.clone()
    assert f.forward_add(x, r2, out=r2) is r2 and torch.equal(r2, want)


def test_bf16_linear_forward_add_matches_residual_plus_output():
    lin = Linear(32, 32, bias=False).to(torch.bfloat16)
    x, res = rand(4, 32, dtype=torch.bfloat16), rand(4, 32, seed=1, dtype=torch.bfloat16)
    torch.testing.assert_close(lin.forward_add(x, res), res + lin(x))
    r2 = res.clone()
    assert lin.forward_add(x, r2, out=r2) is r2


def test_a_projection_not_a_multiple_of_16_is_refused_with_the_flag_to_change():
    with pytest.raises(ValueError, match="--quantization none"):
        fp8.Fp8Linear.from_linear(Linear(24, 64, bias=False))


def tiny(dtype=torch.float32) -> LlamaForCausalLM:
    cfg = dataclasses.replace(model_config("tiny"), dtype=dtype)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.05)
    return m.eval()


def causal(layer, q, k, v):
    from prefill_server.layers.attention import dense_attention
    return dense_attention(q, k, v, q.shape[-1] ** -0.5)


def test_quantize_model_replaces_the_projections_only_and_stays_close():
    m = tiny()
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40)
    ref = m(ids, pos, causal)
    fp8.quantize_model(m)
    for layer in m.model.layers:
        for parent, name in fp8.PROJECTIONS:
            assert isinstance(getattr(getattr(layer, parent), name), fp8.Fp8Linear)
    assert not isinstance(m.lm_head, fp8.Fp8Linear) and m.lm_head.weight.dtype == torch.float32
    got = m(ids, pos, causal)
    assert ((got - ref).norm() / ref.norm()) < 0.1  # e4m3 rounding of every projection, two layers deep
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_quantization_flag_is_validated():
    EngineConfig(quantization="fp8").validate()
    assert fp8.unsupported(torch.device("cpu"), torch.float32) is None  # emulated off CUDA
    with pytest.raises(ValueError, match="--quantization must be auto, none, fp8"):
        EngineConfig(quantization="int4").validate()


def test_fp8_kv_is_never_served_from_bf16_cache_entries():
    from prefill_server.engine.build import LoadedModel, make_pool
    tok = None
    cfg = tiny().config
    pools = [make_pool(EngineConfig(num_kv_blocks=4, block_size=16),
                       LoadedModel("m", cfg, None, tok, torch.float32, torch.device("cpu"), q)) for q in ("none", "fp8")]
    assert pools[0].cache_salt != pools[1].cache_salt


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(1, 4096), (37, 576), (8192, 14336), (5, 16)])
def test_gpu_triton_pass_equals_the_reference_bit_for_bit(shape):
    x = rand(*shape, seed=shape[0], dtype=torch.bfloat16, device="cuda") * 3
    x[0] = 0  # a zero row
    q, s = fp8.quantize_rows(x)
    rq, rs = fp8.quantize_rows_reference(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
@cuda
def test_gpu_scaled_mm_equals_the_emulation_to_bf16_rounding():
    lin = Linear(4096, 6144, bias=False).to("cuda", torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
    f = fp8.Fp8Linear.from_linear(lin)
    x = rand(1000, 4096, dtype=torch.bfloat16, device="cuda")
    xq, xs = fp8.quantize_rows_reference(x)
    want = ((xq.float() * xs) @ f.dequantized().t())
    got = f(x)
    assert got.dtype == torch.bfloat16
    # the tensor core's own partial sums (use_fast_accum) and the bf16 output: measured 2-3e-3
    assert ((got.float() - want).norm() / want.norm()) < 5e-3
    assert (got.float() - want).abs().max() < 0.02 * want.abs().max()


def within_one_code(got: fp8.Quantized, want_values: torch.Tensor) -> None:
    """got's codes against quantizing want_values [T, C] float32: the scales agree to float32
    summation order, and codes differ by at most one step, rarely (a value near a rounding boundary)."""
    rq, rs = fp8.quantize_rows_reference(want_values)
    torch.testing.assert_close(got.scale, rs, rtol=1e-5, atol=0)
    a, b = got.data.float() * got.scale, rq.float() * rs
    assert ((a - b).abs() <= b.abs() * 2 ** -3 + rs * 2 ** -9).all()
    assert (got.data.view(torch.uint8) == rq.view(torch.uint8)).float().mean() > 0.999


@pytest.mark.gpu
@cuda
def test_gpu_rms_norm_writes_the_codes_of_its_float32_output():
    from prefill_server.layers.norm import RMSNorm
    norm = RMSNorm(4096, 1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * rand(4096, seed=8, device="cuda"))
    proj = fp8.Fp8Linear.from_linear(Linear(4096, 64, bias=False).to("cuda", torch.bfloat16))
    x = rand(300, 4096, seed=9, dtype=torch.bfloat16, device="cuda") * 4
    got = fp8.rms_norm_for(proj, norm, x)
    assert isinstance(got, fp8.Quantized)
    xf = x.float()
    within_one_code(got, norm.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)))
    assert isinstance(fp8.rms_norm_for(Linear(4096, 64, bias=False), norm, x), torch.Tensor)  # bf16 projection


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("one_pass_max", [fp8.SILU_ONE_PASS_MAX, 0])  # the row in registers, or read twice
def test_gpu_silu_mul_writes_the_codes_of_its_float32_output(one_pass_max, monkeypatch):
    monkeypatch.setattr(fp8, "SILU_ONE_PASS_MAX", one_pass_max)
    proj = fp8.Fp8Linear.from_linear(Linear(14336, 64, bias=False).to("cuda", torch.bfloat16))
    gu = rand(200, 2 * 14336, seed=10, dtype=torch.bfloat16, device="cuda") * 3
    got = fp8.silu_mul_for(proj, gu)
    g, u = gu.float().chunk(2, dim=-1)
    within_one_code(got, g * torch.sigmoid(g) * u)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)])
def test_gpu_rope_writes_fp8_q_and_k_codes_beside_k(scales):
    """FP8 scores' inputs from the one rope pass: q only as the codes of rope(q) / q_scale, k as the
    bf16 values the pages get and as their codes, v copied; the codes are those of the bf16 values
    (``fp8.to_e4m3``: saturating at +-448), as vLLM quantizes its bf16 query."""
    from prefill_server.layers import fused
    from prefill_server.layers.rotary import RotaryEmbedding
    t, hq, hkv, d = 300, 32, 8, 128
    qkv = rand(t, (hq + 2 * hkv) * d, seed=11, dtype=torch.bfloat16, device="cuda") * 4
    qkv[0, :d] = 2000.0  # past e4m3's range: saturates
    cos, sin = RotaryEmbedding(d, 500000.0).cos_sin(torch.arange(t, device="cuda") + 5, torch.bfloat16)
    q8, k, v, k8 = fused.rope_qkv(qkv, cos, sin, hq, hkv, d, fp8_scales=scales)
    bq, bk, bv = fused.rope_qkv(qkv, cos, sin, hq, hkv, d)
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn and torch.equal(k, bk) and torch.equal(v, bv)
    assert torch.equal(q8.view(torch.uint8), fp8.to_e4m3(bq, scales[0]).view(torch.uint8))
    assert torch.equal(k8.view(torch.uint8), fp8.to_e4m3(bk, scales[1]).view(torch.uint8))
    assert q8.float().abs().max() == 448.0 and not q8.float().isnan().any()


@pytest.mark.gpu
@cuda
def test_gpu_engine_with_fp8_pages_takes_fp8_scores():
    """A step of three whole prompts with FP8 pages through FP8 scores (a random model with SmolLM2's
    head size), against the same step attending (per prompt, cuDNN) on q and k rounded to e4m3 and
    back, which is what FP8 scores compute: equal to the kernels' summation order; and unlike bf16
    scores by FP8's rounding."""
    from prefill_server.engine.kv_pool import KVPool
    from prefill_server.engine.runner import ModelRunner, PagedAttention, _SeqSlice
    from prefill_server.bench.common import random_model
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores: compute capability 8.9+")
    cfg = dataclasses.replace(model_config("tiny"), hidden_size=512, intermediate_size=1024, num_heads=8,
                              num_kv_heads=2, head_dim=64, num_layers=3)
    dev = torch.device("cuda")
    model = random_model(cfg, dev, torch.bfloat16, seed=3)
    with torch.no_grad():  # scores that are not all alike: q/k projections 3x the bench's weights
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight[:cfg.q_size + cfg.kv_size] *= 3
    g = torch.Generator().manual_seed(4)
    prompts = [tuple(torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()) for n in (300, 77, 1000)]

    class RoundedScores(PagedAttention):
        def __call__(self, layer, q, k, v, k8=None):
            assert k8 is None
            return super().__call__(layer, fp8.to_e4m3(q).to(q.dtype), fp8.to_e4m3(k).to(k.dtype), v)

    def step(make_attn):
        pool = KVPool(cfg.num_layers, 128, cfg.num_kv_heads, 16, cfg.head_dim, torch.bfloat16, dev, cache_dtype="fp8")
        slices, t, nb = [], 0, 0
        for p in prompts:
            need = -(-len(p) // 16)
            slices.append(_SeqSlice(t, t + len(p), 0, len(p), list(range(nb, nb + need))))
            t, nb = t + len(p), nb + need
        ids = torch.tensor(sum(prompts, ()), device=dev)
        pos = torch.cat([torch.arange(len(p), device=dev) for p in prompts])
        last = torch.tensor([s.q_end - 1 for s in slices], device=dev)
        with torch.inference_mode():
            logits = model(ids, pos, make_attn(pool, slices), last).float()  # as ModelRunner.run
        return logits, pool.read(cfg.num_layers - 1, slices[2].block_ids, 1000)[0]

    scale = cfg.head_dim ** -0.5
    pool = KVPool(1, 4, cfg.num_kv_heads, 16, cfg.head_dim, torch.bfloat16, dev, cache_dtype="fp8")
    assert ModelRunner(model, pool, cfg.head_dim, dev, fp8_attention="auto").fp8_attention
    fp8_logits, fp8_k = step(lambda pool, sl: PagedAttention(pool, sl, scale, fp8_scores=True))
    ref_logits, ref_k = step(lambda pool, sl: RoundedScores(pool, sl, scale))
    bf_logits, _ = step(lambda pool, sl: PagedAttention(pool, sl, scale))

    def rel(a, b):
        return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())
    assert rel(fp8_logits, ref_logits) < 0.05  # measured 0.029 (H100): bf16 roundings over 3 layers
    assert rel(fp8_logits, bf_logits) > 2 * rel(fp8_logits, ref_logits)  # the FP8 path ran
    assert (fp8_k.float() - ref_k.float()).abs().mean() < 0.02 * ref_k.float().abs().mean()
    # projected in chunks (long prompts): the rope pass writes its codes into the whole-step buffers
    model.chunk_tokens = 256
    chunked_logits, chunked_k = step(lambda pool, sl: PagedAttention(pool, sl, scale, fp8_scores=True))
    assert rel(chunked_logits, fp8_logits) < 2e-2  # (other GEMM shapes: other roundings)
    assert (chunked_k.float() - fp8_k.float()).abs().mean() < 0.01 * fp8_k.float().abs().mean()

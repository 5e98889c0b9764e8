"""The correctness checks of ``bench e2e``: the engine's logits and pool K/V against the same model
run with the plain reference attention and the eager ops (and, on CUDA, both against the model in
float32); each fused kernel against its eager ops; and cuDNN attention on real vs random q/k/v,
alone and right after a GEMM (data vs the GPU's clock state).
"""
from __future__ import annotations

import contextlib
import statistics
from concurrent.futures import Future

import torch
import torch.nn.functional as F

from prefill_server.bench.common import _randn, time_ms
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.runner import ModelRunner
from prefill_server.engine.scheduler import Chunk, Sequence
from prefill_server.engine.types import PrefillRequest
from prefill_server.models.config import ModelConfig
from prefill_server.models.reference_attention import CausalAttention

try:  # absent in older trees (the bench also runs against them for a before/after)
    from prefill_server.layers import fused
except ImportError:  # pragma: no cover
    fused = None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_engine(model, cfg: ModelConfig, pool: KVPool, device, tokens: int, seed: int = 3,
                 fp32: bool = False) -> dict:
    """Engine logits and pool K/V vs the same model with the plain reference attention
    (repeat_interleave + SDPA) and, where the fused kernels exist, the eager ops. With ``fp32`` also
    both against the model in float32 (converted in place and back: bf16 -> fp32 -> bf16 is exact),
    so that the engine's error is judged against the eager path's own bf16 error."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    seq = Sequence(PrefillRequest("check", tuple(ids.tolist())), Future())
    seq.block_ids = pool.allocate(pool.blocks_needed(tokens))
    try:
        runner = ModelRunner(model, pool, cfg.head_dim, device)
        got = runner.run([Chunk(seq, 0, tokens)])[0]
        ref_attn = CausalAttention.single(tokens, record=True)
        off = fused.enabled(False) if fused is not None else contextlib.nullcontext()
        with off, torch.no_grad():
            ref = model(ids.to(device), torch.arange(tokens, device=device), ref_attn,
                        torch.tensor([tokens - 1], device=device))[0]
        out = {"tokens": tokens, "logits_rel_err": _rel(got, ref),
               "logits_cos": float(F.cosine_similarity(got.double(), ref.double(), dim=0)),
               "argmax_equal": int(got.argmax()) == int(ref.argmax()), "finite": bool(torch.isfinite(got).all())}
        for layer in sorted({0, cfg.num_layers - 1}):
            k, v = pool.read(layer, seq.block_ids, tokens)
            out[f"k_rel_err_layer{layer}"] = _rel(k, ref_attn.keys[layer])
            out[f"v_rel_err_layer{layer}"] = _rel(v, ref_attn.values[layer])
        last = cfg.num_layers - 1
        k_eng, _ = pool.read(last, seq.block_ids, tokens)
        if fp32:
            dtype = next(model.parameters()).dtype
            k_ref, ref_attn = ref_attn.keys[last], None
            model.float()
            try:
                a32 = CausalAttention.single(tokens, record=True)
                with fused.enabled(False) if fused is not None else contextlib.nullcontext(), torch.no_grad():
                    r32 = model(ids.to(device), torch.arange(tokens, device=device), a32,
                                torch.tensor([tokens - 1], device=device))[0]
                k32 = a32.keys[last]
                a32 = None
            finally:
                model.to(dtype)
            out.update(engine_vs_fp32_logits=_rel(got, r32), eager_vs_fp32_logits=_rel(ref, r32),
                       engine_vs_fp32_k_last=_rel(k_eng, k32), eager_vs_fp32_k_last=_rel(k_ref, k32),
                       engine_argmax_eq_fp32=int(got.argmax()) == int(r32.argmax()),
                       eager_argmax_eq_fp32=int(ref.argmax()) == int(r32.argmax()))
        del ref_attn
    finally:
        pool.free(seq.block_ids)
    if fp32:  # as accurate as the eager bf16 path, within a margin
        out["pass"] = bool(out["finite"] and out["engine_vs_fp32_logits"] <= 1.5 * out["eager_vs_fp32_logits"] + 1e-3
                           and out["engine_vs_fp32_k_last"] <= 1.5 * out["eager_vs_fp32_k_last"] + 1e-3)
    else:
        out["pass"] = bool(out["finite"] and out["logits_rel_err"] < 5e-2 and out["logits_cos"] > 0.998
                           and all(val < 2e-2 for key, val in out.items() if key.startswith(("k_rel", "v_rel"))))
    return out


def check_fused(cfg: ModelConfig, device, dtype, rows: int = 2048) -> dict:
    """Each fused kernel against its eager ops on random data (CUDA only)."""
    if fused is None or not fused.available(torch.empty(0, device=device)):
        return {"skipped": "fused kernels unavailable here"}
    from prefill_server.layers.rotary import RotaryEmbedding, apply_rotary
    g = torch.Generator(device=device).manual_seed(4)
    c = cfg
    res = {}
    x = _randn((rows, c.hidden_size), device, dtype, g) * 3
    w = (1 + 0.1 * _randn((c.hidden_size,), device, torch.float32, g)).to(dtype)
    xf = x.float()
    eager = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(dtype)
    got = fused.rms_norm(x, w, c.rms_norm_eps)
    res["rms_norm_max_abs"] = float((got.float() - eager.float()).abs().max())
    res["rms_norm_rel"] = _rel(got, eager)
    qkv = _randn((rows, c.q_size + 2 * c.kv_size), device, dtype, g)
    cos, sin = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling).cos_sin(
        torch.randint(0, 100000, (rows,), device=device, generator=g), dtype)
    q, k, v = fused.rope_qkv(qkv, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim)
    eq, ek, ev = torch.split(qkv, [c.q_size, c.kv_size, c.kv_size], dim=-1)
    eq = apply_rotary(eq.reshape(rows, c.num_heads, c.head_dim), cos, sin)
    ek = apply_rotary(ek.reshape(rows, c.num_kv_heads, c.head_dim), cos, sin)
    res["rope_mismatch_frac"] = float(((q != eq).sum() + (k != ek).sum()) / (q.numel() + k.numel()))
    res["rope_max_abs"] = float(max((q.float() - eq.float()).abs().max(), (k.float() - ek.float()).abs().max()))
    res["rope_rel"] = max(_rel(q, eq), _rel(k, ek))
    res["v_copy_exact"] = bool(torch.equal(v, ev.reshape(rows, c.num_kv_heads, c.head_dim)))
    gu = _randn((rows, 2 * c.intermediate_size), device, dtype, g) * 3
    eg, eu = gu.chunk(2, dim=-1)
    es = F.silu(eg) * eu
    gs = fused.silu_mul(gu)
    res["silu_mul_max_abs"] = float((gs.float() - es.float()).abs().max())
    res["silu_mul_rel"] = _rel(gs, es)
    page = torch.full((rows // 16 + 2, c.num_kv_heads, 16, 2 * c.head_dim), float("nan"), device=device, dtype=dtype)
    ref_page = page.clone()
    perm = torch.randperm(page.shape[0], device=device, generator=g)
    pos = torch.arange(rows, device=device)
    blocks, offs = perm[pos // 16], pos % 16
    fused.kv_write(page, blocks, offs, k, v)
    ref_page[blocks, :, offs, : c.head_dim] = k
    ref_page[blocks, :, offs, c.head_dim:] = v
    res["kv_write_exact"] = bool(torch.equal(page.nan_to_num(7.0), ref_page.nan_to_num(7.0)))
    res["pass"] = bool(res["rope_rel"] < 1e-2 and res["v_copy_exact"] and res["kv_write_exact"]
                       and res["rms_norm_rel"] < 1e-2 and res["silu_mul_rel"] < 1e-2)
    return res


def attention_diagnostics(model, cfg: ModelConfig, device, dtype, tokens: int, reps: int = 5) -> dict:
    """cuDNN attention at ``tokens`` on random q/k/v and on the last layer's real q/k/v (captured from
    a forward), each alone and right after a large GEMM as inside a forward: separates effects of the
    data from effects of the GPU's state (clocks under sustained GEMM load)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from prefill_server.layers.attention import dense_attention
    last, scale, cap = cfg.num_layers - 1, cfg.head_dim ** -0.5, {}

    def attn(layer, q, k, v):
        if layer == last:
            cap["qkv"] = (q.clone(), k.clone(), v.clone())
        return dense_attention(q, k, v, scale)
    g = torch.Generator(device=device).manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=device, generator=g)
    with torch.no_grad():
        model(ids, torch.arange(tokens, device=device), attn, torch.tensor([tokens - 1], device=device))
    rnd = tuple(_randn(z.shape, device, dtype, g) for z in cap["qkv"])
    w = model.model.layers[0].mlp.gate_up_proj.weight
    xg = _randn((8192, w.shape[1]), device, dtype, g)
    res: dict = {"tokens": tokens}
    for name, (q, k, v) in (("random", rnd), ("captured", cap["qkv"])):
        qh, kh, vh = (z.transpose(0, 1)[None] for z in (q, k, v))
        f = lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,  # noqa: E731
                                                   enable_gqa=True)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            res[f"{name}_alone_ms"] = time_ms(f, device, reps)[0]
            times = []
            for _ in range(reps + 1):
                F.linear(xg, w)
                F.linear(xg, w)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                f()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            res[f"{name}_after_gemm_ms"] = statistics.median(times[1:])
        res[f"{name}_q_absmax"], res[f"{name}_k_absmax"] = float(q.abs().max()), float(k.abs().max())
        res[f"{name}_q_std"], res[f"{name}_k_std"] = float(q.float().std()), float(k.float().std())
    return res

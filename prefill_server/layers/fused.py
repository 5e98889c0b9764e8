"""Single-pass GPU kernels (Triton) for the elementwise parts of a layer.

In PyTorch eager mode each of these is several passes over a large activation: RMSNorm in float32
is six (upcast, square, mean, scale, downcast, weight), rotary four to six (mul, neg, cat, mul, add)
plus a copy of v, SiLU-and-multiply two, a KV page write one index kernel per tensor. Here each is
one read and one write. Arithmetic is float32 with one rounding to the storage dtype at the end,
like the eager code in the callers and like vLLM's own kernels (checked against vLLM 0.32's CPU
ops: rotary, silu_and_mul and rms_norm agree bit for bit with "float32 math, one rounding"); in
float32 they agree with the eager ops to float32 rounding (tests/bench, Triton's interpreter).

Used only for CUDA tensors when Triton is importable; the CPU path (and every CPU test) is the plain
PyTorch code in the callers. ``enabled(False)`` turns the fast paths off (benchmarks, checks).
"""
from __future__ import annotations

import contextlib

import torch

_ENABLED = True


@contextlib.contextmanager
def enabled(flag: bool):
    """Context manager: run the enclosed code with the fused kernels on or off."""
    global _ENABLED
    prev, _ENABLED = _ENABLED, flag
    try:
        yield
    finally:
        _ENABLED = prev


try:  # Triton is a dependency of torch's CUDA builds; absent on some CPU installs
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

_KERNELS: dict | None = None

if triton is not None:

    @triton.jit
    def rms_norm_kernel(X, W, Y, stride_x, stride_y, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n
        y = x * tl.rsqrt(var + eps)  # weight applied in float32, one rounding (as vLLM's rms_norm)
        w = tl.load(W + cols, mask=m, other=0.0)
        tl.store(Y + row * stride_y + cols, (w.to(tl.float32) * y).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _e4m3(x, scale):
        """x / scale as e4m3 codes, saturating as vLLM's FP8 quantization (out-of-range values become
        +-448, not NaN; KVFormat.store)"""
        z = x.to(tl.float32) / scale
        return tl.minimum(tl.maximum(z, -448.0), 448.0).to(tl.float8e4nv)

    @triton.jit
    def _rope_heads(src, dst, dst8, scale8, c1, c2, s1, s2, nh, D: tl.constexpr, HALF: tl.constexpr,
                    BH: tl.constexpr, MODE: tl.constexpr):
        """rope(src) rounded to src's dtype; MODE 0: into dst; 1: only its e4m3 codes of value / scale8
        into dst; 2: both, the codes into dst8. The codes are those of the rounded values, as vLLM
        quantizes its bf16 query and its cache write quantizes k."""
        h = tl.arange(0, BH)[:, None]
        j = tl.arange(0, HALF)[None, :]
        m = h < nh
        x1 = tl.load(src + h * D + j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + h * D + HALF + j, mask=m, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin in float32, rounded once (eager bf16 rounds after each op)
        dt = src.dtype.element_ty
        y1 = (x1 * c1 - x2 * s1).to(dt)
        y2 = (x2 * c2 + x1 * s2).to(dt)
        if MODE == 1:
            dst8 = dst
        else:
            tl.store(dst + h * D + j, y1.to(dst.dtype.element_ty), mask=m)
            tl.store(dst + h * D + HALF + j, y2.to(dst.dtype.element_ty), mask=m)
        if MODE != 0:
            tl.store(dst8 + h * D + j, _e4m3(y1, scale8), mask=m)
            tl.store(dst8 + h * D + HALF + j, _e4m3(y2, scale8), mask=m)

    @triton.jit
    def rope_qkv_kernel(QKV, COS, SIN, Q, K, V, K8, stride_qkv, stride_cs, stride_q, stride_k, stride_v,
                        stride_k8, q_scale, k_scale, HQ, HKV, D: tl.constexpr, HALF: tl.constexpr,
                        BHQ: tl.constexpr, BHKV: tl.constexpr, BV: tl.constexpr, FP8: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, HALF)[None, :]
        cs = COS + t * stride_cs
        sn = SIN + t * stride_cs
        c1 = tl.load(cs + j).to(tl.float32)
        c2 = tl.load(cs + HALF + j).to(tl.float32)
        s1 = tl.load(sn + j).to(tl.float32)
        s2 = tl.load(sn + HALF + j).to(tl.float32)
        row = QKV + t * stride_qkv
        # FP8: q only as e4m3 codes (attention's FP8 scores), k both as values and codes
        _rope_heads(row, Q + t * stride_q, Q, q_scale, c1, c2, s1, s2, HQ, D, HALF, BHQ, 1 if FP8 else 0)
        _rope_heads(row + HQ * D, K + t * stride_k, K8 + t * stride_k8, k_scale, c1, c2, s1, s2, HKV, D, HALF,
                    BHKV, 2 if FP8 else 0)
        offs = tl.arange(0, BV)
        nv = HKV * D
        vv = tl.load(row + (HQ + HKV) * D + offs, mask=offs < nv)
        tl.store(V + t * stride_v + offs, vv, mask=offs < nv)

    @triton.jit
    def silu_mul_kernel(GU, OUT, stride_gu, stride_out, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n
        g = tl.load(GU + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_gu + n + cols, mask=m, other=0.0).to(tl.float32)
        dt = OUT.dtype.element_ty
        act = g / (1.0 + tl.exp(-g))  # float32 throughout, one rounding (as vLLM's silu_and_mul)
        tl.store(OUT + row * stride_out + cols, (act * u).to(dt), mask=m)

    @triton.jit
    def kv_write_kernel(PAGE, BLOCKS, OFFS, K, V, stride_pb, stride_ph, stride_pn, stride_kt, stride_kh,
                        stride_vt, stride_vh, k_scale, v_scale, H, D: tl.constexpr, BH: tl.constexpr,
                        FP8: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        b = tl.load(BLOCKS + t).to(tl.int64)
        o = tl.load(OFFS + t).to(tl.int64)
        h = tl.arange(0, BH)[:, None]
        d = tl.arange(0, D)[None, :]
        m = h < H
        dst = PAGE + b * stride_pb + o * stride_pn + h * stride_ph + d
        kk = tl.load(K + t * stride_kt + h * stride_kh + d, mask=m)
        vv = tl.load(V + t * stride_vt + h * stride_vh + d, mask=m)
        if FP8:  # e4m3 pages: K / k_scale, V / v_scale (KVFormat.store)
            tl.store(dst, _e4m3(kk, k_scale), mask=m)
            tl.store(dst + D, _e4m3(vv, v_scale), mask=m)
        else:
            tl.store(dst, kk.to(PAGE.dtype.element_ty), mask=m)
            tl.store(dst + D, vv.to(PAGE.dtype.element_ty), mask=m)

    _KERNELS = {"rms_norm": rms_norm_kernel, "rope_qkv": rope_qkv_kernel, "silu_mul": silu_mul_kernel,
                "kv_write": kv_write_kernel}


def available(x: torch.Tensor) -> bool:
    """True when the fused kernels should run on ``x``: CUDA tensor, Triton present, not disabled."""
    return _ENABLED and x.is_cuda and _KERNELS is not None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., n] -> [..., n] like ``RMSNorm.forward``; None if x's rows are not one-stride rows."""
    n = x.shape[-1]
    if x.stride(-1) != 1 or weight.dtype != x.dtype:
        return None
    x2 = x if x.dim() == 2 else x.reshape(-1, n) if x.is_contiguous() else None
    if x2 is None or x2.shape[0] == 0:
        return None
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = _pow2(n)
    _KERNELS["rms_norm"][(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), n, eps, BLOCK=block,
                                         num_warps=8 if block >= 2048 else 4)
    return y.view(x.shape)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int,
             out: tuple[torch.Tensor, ...] | None = None, fp8_scales: tuple[float, float] | None = None):
    """qkv [T, (hq + 2 hkv) d] (one fused projection's rows), cos/sin [T, d] ->
    q [T, hq, d], k [T, hkv, d] roped and v [T, hkv, d], each contiguous per token (written into
    ``out`` when given). None (nothing written) where the kernel does not apply: d / 2 not a power
    of two.

    fp8_scales (q_scale, k_scale): q comes back as e4m3 codes of q / q_scale instead, and a fourth
    tensor k8 [T, hkv, d] holds the codes of k / k_scale (both of the values rounded to qkv's dtype,
    ``fp8.to_e4m3``): the inputs of attention's FP8 scores (``out`` then has four tensors too)."""
    t = qkv.shape[0]
    if _pow2(d // 2) != d // 2 or d % 2:
        return None
    f8 = torch.float8_e4m3fn
    if out is None:
        q = torch.empty(t, hq, d, dtype=f8 if fp8_scales else qkv.dtype, device=qkv.device)
        k = torch.empty(t, hkv, d, dtype=qkv.dtype, device=qkv.device)
        v = torch.empty(t, hkv, d, dtype=qkv.dtype, device=qkv.device)
        k8 = torch.empty(t, hkv, d, dtype=f8, device=qkv.device) if fp8_scales else None
    else:
        q, k, v, k8 = out if fp8_scales else (*out, None)
    res = (q, k, v, k8) if fp8_scales else (q, k, v)
    if t == 0:
        return res
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    for z in res:
        assert z.stride(-1) == 1 and z.stride(-2) == d, z.stride()
    if fp8_scales:
        assert q.dtype == k8.dtype == f8, (q.dtype, k8.dtype)
    q_scale, k_scale = fp8_scales or (1.0, 1.0)
    _KERNELS["rope_qkv"][(t,)](qkv, cos, sin, q, k, v, k if k8 is None else k8, qkv.stride(0), cos.stride(0),
                                 q.stride(0), k.stride(0), v.stride(0), (k if k8 is None else k8).stride(0),
                                 q_scale, k_scale, hq, hkv, D=d, HALF=d // 2, BHQ=_pow2(hq), BHKV=_pow2(hkv),
                                 BV=_pow2(hkv * d), FP8=bool(fp8_scales), num_warps=4)
    return res


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2n] (gate then up) -> silu(gate) * up [T, n]."""
    t, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _KERNELS["silu_mul"][(t, (n + block - 1) // block)](gate_up, out, gate_up.stride(0), out.stride(0),
                                                              n, BLOCK=block, num_warps=4)
    return out


def kv_write(page: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, scales: tuple[float, float] | None = None) -> bool:
    """page [NB, H, N, 2D] (one layer); k, v [T, H, D] written at (blocks[t], :, offsets[t]), cast to
    the page's dtype; with ``scales`` (k_scale, v_scale) into e4m3 pages as vLLM quantizes them.
    False (nothing written) where the kernel does not apply: head_dim not a power of two."""
    t, h, d = k.shape
    if _pow2(d) != d or k.stride(-1) != 1 or v.stride(-1) != 1 or page.stride(-1) != 1:
        return False
    if t == 0:
        return True
    assert scales is None or page.dtype == torch.float8_e4m3fn, page.dtype
    _KERNELS["kv_write"][(t,)](page, blocks, offsets, k, v, page.stride(0), page.stride(1), page.stride(2),
                                 k.stride(0), k.stride(1), v.stride(0), v.stride(1), *(scales or (1.0, 1.0)),
                                 h, D=d, BH=_pow2(h), FP8=scales is not None, num_warps=4)
    return True

"""FP8 (e4m3) linear layers: weights per output channel, activations per token, both scaled by
their row's absolute maximum / 448 (vLLM's "fp8" with dynamic per-token activation scales).

``Fp8Linear`` replaces a bf16 ``Linear`` / ``MergedLinear`` of a decoder layer (``quantize_model``);
the embedding and ``lm_head`` stay in the model dtype, as vLLM keeps them. The GEMM on CUDA is
``torch._scaled_mm`` (rowwise scales, float32 accumulation, one rounding to the model dtype); the
per-token quantization is one Triton pass (amax, scale, cast). Off CUDA the same arithmetic is
emulated in float32 (quantize, dequantize, matmul): slow, but every CPU test, the accuracy checks
on SmolLM2 included, sees the numbers the GPU computes up to float32 summation order.

Only the KV this server writes depends on the choice: the decode keeps its own weights.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from prefill_server.layers import fused
from prefill_server.layers.linear import add_residual

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# scale = amax * INV_FP8_MAX (float32), codes = x * (1 / scale): the same roundings in torch (CPU and
# CUDA) and in the kernels, so the emulation and the GPU quantize alike, code for code
INV_FP8_MAX = 1.0 / FP8_MAX
# the smallest scale: an all-zero row quantizes to zeros instead of dividing by zero (vLLM's floor)
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# torch._scaled_mm needs both GEMM dimensions of the weight to be multiples of 16
ALIGN = 16

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:

    @triton.jit
    def _scale_of(amax, inv_fp8_max, min_scale):
        """A row's (scale, 1 / scale) from its absolute maximum; IEEE reciprocal (Triton's "/" is the
        approximate one), as torch.reciprocal."""
        scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, min_scale)
        return scale, tl.div_rn(1.0, scale)

    @triton.jit
    def _store_codes(Q, y, inv, cols, m, fp8_max):
        q = tl.minimum(tl.maximum(y * inv, -fp8_max), fp8_max)
        tl.store(Q + cols, q.to(Q.dtype.element_ty), mask=m)

    @triton.jit
    def quant_rows_kernel(X, Q, S, stride_x, stride_q, n, fp8_max, inv_fp8_max, min_scale, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, n, BLOCK):
            cols = s + tl.arange(0, BLOCK)
            x = tl.load(X + row * stride_x + cols, mask=cols < n, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale, inv = _scale_of(amax, inv_fp8_max, min_scale)
        for s in range(0, n, BLOCK):  # the row again: 8-28 KiB, still in L2
            cols = s + tl.arange(0, BLOCK)
            m = cols < n
            x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
            _store_codes(Q + row * stride_q, x, inv, cols, m, fp8_max)
        tl.store(S + row, scale)

    @triton.jit
    def rms_norm_quant_kernel(X, W, Q, S, stride_x, stride_q, n, eps, fp8_max, inv_fp8_max, min_scale,
                              BLOCK: tl.constexpr):
        """RMSNorm (float32, as fused.rms_norm) whose output goes out as FP8 codes + the row's scale."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n
        y = tl.load(W + cols, mask=m, other=0.0).to(tl.float32) * (x * tl.rsqrt(var + eps))
        scale, inv = _scale_of(tl.abs(y), inv_fp8_max, min_scale)
        _store_codes(Q + row * stride_q, y, inv, cols, m, fp8_max)
        tl.store(S + row, scale)

    @triton.jit
    def silu_mul_quant_kernel(GU, Q, S, stride_gu, stride_q, n, fp8_max, inv_fp8_max, min_scale,
                              BLOCK: tl.constexpr):
        """silu(gate) * up (float32, as fused.silu_mul) out as FP8 codes + the row's scale; the row is
        computed twice (amax, then codes) rather than stored."""
        row = tl.program_id(0).to(tl.int64)
        base = GU + row * stride_gu
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, n, BLOCK):
            cols = s + tl.arange(0, BLOCK)
            m = cols < n
            g = tl.load(base + cols, mask=m, other=0.0).to(tl.float32)
            u = tl.load(base + n + cols, mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(g / (1.0 + tl.exp(-g)) * u))
        scale, inv = _scale_of(amax, inv_fp8_max, min_scale)
        for s in range(0, n, BLOCK):
            cols = s + tl.arange(0, BLOCK)
            m = cols < n
            g = tl.load(base + cols, mask=m, other=0.0).to(tl.float32)
            u = tl.load(base + n + cols, mask=m, other=0.0).to(tl.float32)
            _store_codes(Q + row * stride_q, g / (1.0 + tl.exp(-g)) * u, inv, cols, m, fp8_max)
        tl.store(S + row, scale)

    @triton.jit
    def silu_mul_quant_row_kernel(GU, Q, S, stride_gu, stride_q, n, fp8_max, inv_fp8_max, min_scale,
                                  BLOCK: tl.constexpr):
        """As silu_mul_quant_kernel with the whole row held in registers: one read of gate_up."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        g = tl.load(GU + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_gu + n + cols, mask=m, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        scale, inv = _scale_of(tl.abs(y), inv_fp8_max, min_scale)
        _store_codes(Q + row * stride_q, y, inv, cols, m, fp8_max)
        tl.store(S + row, scale)


# silu_mul_for computes rows up to this many columns (a power of two) in one pass (the row in
# registers): the two-pass kernel's second read is not an L2 hit once eight 56 KB rows per SM are in
# flight (the 8B shape), docs/bench/2026-12-06-fp8-fold/
SILU_ONE_PASS_MAX = 16384


class Quantized(NamedTuple):
    """Activations as an Fp8Linear takes them: codes [T, C] e4m3 and one float32 scale per row [T, 1]."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def is_cuda(self) -> bool:
        return self.data.is_cuda


def to_e4m3(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x / scale as e4m3 codes with one scale for the tensor, saturating as vLLM's FP8 quantization
    (out-of-range values become +-448, not NaN): FP8 KV pages, attention's FP8 q and k."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q [R, C] e4m3, scale [R, 1] float32) with x ~= q * scale, row by row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) * INV_FP8_MAX).clamp(min=MIN_SCALE)
    return (xf * torch.reciprocal(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``quantize_rows_reference``; one Triton pass for a CUDA x whose rows are contiguous."""
    if not _fusable(x):
        return quantize_rows_reference(x)
    r, c = x.shape
    q = torch.empty(r, c, dtype=FP8, device=x.device)
    s = torch.empty(r, 1, dtype=torch.float32, device=x.device)
    block = min(4096, triton.next_power_of_2(c))
    quant_rows_kernel[(r,)](x, q, s, x.stride(0), q.stride(0), c, FP8_MAX, INV_FP8_MAX, MIN_SCALE, BLOCK=block,
                            num_warps=8)
    return q, s


def _fusable(x: torch.Tensor) -> bool:
    return triton is not None and fused.available(x) and x.dim() == 2 and x.stride(-1) == 1 and x.shape[0] > 0


def rms_norm_for(proj: nn.Module, norm: nn.Module, x: torch.Tensor) -> torch.Tensor | Quantized:
    """norm(x) [T, C] as ``proj`` takes it: for an Fp8Linear on CUDA, FP8 codes and scales in one pass
    (the normalized value is not rounded to the model dtype first); otherwise norm(x)."""
    n = x.shape[-1]
    if not isinstance(proj, Fp8Linear) or not _fusable(x) or triton.next_power_of_2(n) > 16384:
        return norm(x)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    rms_norm_quant_kernel[(x.shape[0],)](x, norm.weight, q, s, x.stride(0), q.stride(0), n, norm.eps, FP8_MAX,
                                         INV_FP8_MAX, MIN_SCALE, BLOCK=triton.next_power_of_2(n), num_warps=8)
    return Quantized(q, s)


def silu_mul_for(proj: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | Quantized:
    """silu(gate) * up as ``proj`` takes it (gate_up [T, 2n] CUDA): FP8 codes and scales for an
    Fp8Linear, else ``fused.silu_mul``."""
    if not isinstance(proj, Fp8Linear) or not _fusable(gate_up):
        return fused.silu_mul(gate_up)
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty(t, n, dtype=FP8, device=gate_up.device)
    s = torch.empty(t, 1, dtype=torch.float32, device=gate_up.device)
    block = triton.next_power_of_2(n)
    if block <= SILU_ONE_PASS_MAX:
        silu_mul_quant_row_kernel[(t,)](gate_up, q, s, gate_up.stride(0), q.stride(0), n, FP8_MAX, INV_FP8_MAX,
                                        MIN_SCALE, BLOCK=block, num_warps=max(4, min(16, block // 1024)))
    else:
        silu_mul_quant_kernel[(t,)](gate_up, q, s, gate_up.stride(0), q.stride(0), n, FP8_MAX, INV_FP8_MAX,
                                    MIN_SCALE, BLOCK=2048, num_warps=8)
    return Quantized(q, s)


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """A CUDA device of compute capability 8.9 or newer (L4, L40S, H100, H200, B200)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when FP8 layers run here in ``dtype``; otherwise why not (the error a user sees)."""
    if device.type != "cuda":
        return None  # emulated: correct, slow (tests, accuracy checks)
    if not has_fp8_tensor_cores(device):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"--quantization fp8 needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: "
                f"L4, L40S, H100, H200, B200); {torch.cuda.get_device_name(device)} is {major}.{minor}. "
                f"Use --quantization none")
    if dtype != torch.bfloat16:
        return f"--quantization fp8 on a GPU needs --dtype bfloat16 (the FP8 GEMMs write bf16), not {dtype}"
    return None


class Fp8Linear(nn.Module):
    """y = x W^T + b with W stored as e4m3 [out, in] and one float32 scale per output row."""

    # torch._scaled_mm's use_fast_accum (Hopper: partial sums stay in the tensor core's accumulator
    # instead of being promoted to float32 registers): on the H200's 8B-shaped GEMMs at 64K rows 5-11%
    # faster, with 2-3e-3 relative error against exact float32 sums where promotion has 1.7e-3, both
    # far below FP8's own rounding (3.75% against bf16). docs/bench/2026-12-03-fp8/
    fast_accum = True

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 output_sizes: list[int] | None = None, out_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        assert weight.dtype == FP8 and weight.dim() == 2 and scale.shape == (weight.shape[0],), (weight.shape, scale.shape)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] e4m3
        self.weight_scale = nn.Parameter(scale.float().reshape(1, -1).contiguous(), requires_grad=False)  # [1, out]
        self.bias = None if bias is None else nn.Parameter(bias.to(out_dtype), requires_grad=False)
        self.output_sizes = list(output_sizes or [self.out_features])
        self.out_dtype = out_dtype

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> Fp8Linear:
        """Quantize a bf16 / fp16 / fp32 Linear (or MergedLinear): each output row by its amax."""
        w = lin.weight.detach()
        out_f, in_f = w.shape
        if out_f % ALIGN or in_f % ALIGN:
            raise ValueError(f"--quantization fp8: a {in_f} -> {out_f} projection is not a multiple of {ALIGN} "
                             f"in both dimensions, which FP8 GEMMs need; use --quantization none for this model")
        q, s = quantize_rows_reference(w)
        return cls(q, s.reshape(-1), None if lin.bias is None else lin.bias.detach(),
                   getattr(lin, "output_sizes", None), w.dtype)

    def dequantized(self) -> torch.Tensor:
        """W as float32 [out, in] (tests; the emulated path)."""
        return self.weight.float() * self.weight_scale.reshape(-1, 1)

    def forward(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        """x [T, in] (or already quantized) -> [T, out] in the model dtype."""
        xq, xs = x if isinstance(x, Quantized) else quantize_rows(x)
        if xq.is_cuda:
            return torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale, bias=self.bias,
                                    out_dtype=self.out_dtype, use_fast_accum=self.fast_accum)
        y = (xq.float() * xs) @ self.dequantized().t()  # float32, rounded once below, like the GEMM's epilogue
        if self.bias is not None:
            y += self.bias.float()
        return y.to(self.out_dtype)

    def forward_split(self, x: torch.Tensor | Quantized) -> tuple[torch.Tensor, ...]:
        return torch.split(self.forward(x), self.output_sizes, dim=-1)

    def forward_add(self, x: torch.Tensor | Quantized, residual: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """residual + self(x), into ``out`` (which may be ``residual``) when given."""
        return add_residual(residual, self.forward(x), out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per-channel"


# the projections of a decoder layer that run in FP8 (the embedding and lm_head do not)
PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


@torch.no_grad()
def quantize_model(model: nn.Module) -> nn.Module:
    """Replace every decoder layer's projections by ``Fp8Linear``, layer by layer (the bf16 weights
    of one layer are freed before the next is quantized: peak memory is one layer above the FP8 model)."""
    for layer in model.model.layers:
        for parent, name in PROJECTIONS:
            owner = getattr(layer, parent)
            setattr(owner, name, Fp8Linear.from_linear(getattr(owner, name)))
    return model

"""RMSNorm.

Off CUDA (and whenever the fused kernels are off) it computes exactly what a vLLM 0.32 decode runs
by default (``vllm/ir/ops/layernorm.py``, the "native" IR ops its CPU build picks): float32
statistics, the normalized value rounded to the model dtype, then multiplied by the weight in the
model dtype; and ``add_forward`` is its fused add + norm, which normalizes the float32 sum of the
residual and the layer output (unrounded) while carrying the rounded sum on as the residual. Bit
equality of our KV with a vLLM CPU decode's depends on that (docs/e2e-cpu-notes.md). On CUDA one
fused pass (``layers.fused``: float32 statistics, weight in float32, one rounding).
"""
from __future__ import annotations

import torch
from torch import nn

from prefill_server.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim] -> [..., dim]
        if fused.available(x):
            y = fused.rms_norm(x, self.weight, self.eps)
            if y is not None:
                return y
        return self._native(x.float(), x.dtype)

    def add_forward(self, delta: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """delta, residual [..., dim] -> (norm(residual + delta), residual + delta rounded to the
        input dtype). Off CUDA the norm sees the float32 sum before rounding (vLLM's fused add)."""
        if fused.available(residual):
            new_residual = residual + delta
            return self.forward(new_residual), new_residual
        total = residual.float() + delta.float()
        return self._native(total, residual.dtype), total.to(residual.dtype)

    def _native(self, xf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """xf float32 [..., dim] -> [..., dim] in dtype: normalize in float32, round, then weight."""
        variance = xf.pow(2).mean(-1, keepdim=True)
        y = (xf * torch.rsqrt(variance + self.eps)).to(dtype)
        return y * self.weight.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

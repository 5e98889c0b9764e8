"""RMSNorm as vLLM's kernels compute it: float32 statistics, the weight applied in float32, one
rounding to the input dtype (Hugging Face rounds before applying the weight: up to one bf16 ulp
apart). On CUDA one fused pass (``layers.fused``); elsewhere the plain PyTorch ops."""
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
        in_dtype = x.dtype
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.eps)
        return (xf * self.weight.float()).to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

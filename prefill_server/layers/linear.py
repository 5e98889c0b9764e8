"""Linear layers. ``Linear`` adds ``forward_add`` (a residual add riding in the GEMM on CUDA);
``MergedLinear`` is one matmul for several projections of the same input (q|k|v, gate|up); the
loader concatenates the checkpoint's separate weights along dim 0. ``layers.fp8.Fp8Linear`` has
the same three methods."""
from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Linear):
    def forward_add(self, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """residual + self(x), into ``out`` (which may be ``residual``) when given. On CUDA without a
        bias one GEMM accumulates into the result (beta = 1): one rounding where eager rounds twice."""
        if self.bias is None and x.is_cuda:
            if out is residual:
                return residual.addmm_(x, self.weight.t())
            return torch.addmm(residual, x, self.weight.t(), out=out)
        return add_residual(residual, self(x), out)


def add_residual(residual: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """residual + y: in place when ``out`` is ``residual``, into ``out``, or a new tensor."""
    if out is residual:
        return residual.add_(y)
    return torch.add(residual, y, out=out) if out is not None else residual + y


class MergedLinear(Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(output_sizes), bias=bias, dtype=dtype)
        self.output_sizes = list(output_sizes)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [T, in] -> one [T, size_i] view per output (views into a single [T, sum] result)."""
        return torch.split(super().forward(x), self.output_sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, output_sizes={self.output_sizes}"

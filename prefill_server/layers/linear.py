"""Linear helpers. ``MergedLinear`` is one matmul for several projections of the same input
(q|k|v, gate|up); the loader concatenates the checkpoint's separate weights along dim 0."""
from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(output_sizes), bias=bias, dtype=dtype)
        self.output_sizes = list(output_sizes)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [T, in] -> one [T, size_i] view per output (views into a single [T, sum] result)."""
        return torch.split(super().forward(x), self.output_sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, output_sizes={self.output_sizes}"

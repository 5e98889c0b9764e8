"""The engine's sparse-attention hook: block-sparse attention for long sequences, dense otherwise.

``PagedAttention`` asks ``wants(layer, k_len)`` per sequence and layer; when true, ``attend`` plans
(estimates the blocks that matter, on the device, no host sync) and runs the block-sparse kernel.
Short sequences and the first layers stay dense (``SparseConfig.dense_len_threshold`` /
``dense_first_layers``; the first layers only up to ``dense_first_layers_max_len`` keys, longer
prompts run them sparse too), through the same dense dispatch as the dense mode.
"""
from __future__ import annotations

import torch

from prefill_server.kernels.block_sparse import SparseConfig, plan


class SparseAttention:
    def __init__(self, config: SparseConfig | None = None):
        self.config = config or SparseConfig()

    def wants(self, layer: int, k_len: int) -> bool:
        return not self.config.dense_for(layer, k_len)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [Tq, Hq, D], k/v [Tk, Hkv, D] of one sequence (queries = its last Tq positions) -> [Tq, Hq, D]."""
        cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
        out, _lse = plan(q, k, cu_q, cu_k, self.config, layer=layer, scale=scale).run(q, k, v)
        return out

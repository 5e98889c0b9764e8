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

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               k8: torch.Tensor | None = None, qk_descale: float = 1.0) -> torch.Tensor:
        """q [Tq, Hq, D], k/v [Tk, Hkv, D] of one sequence (queries = its last Tq positions) -> [Tq, Hq, D].
        FP8 scores: q as e4m3 codes and k8 [Tk, Hkv, D] k's codes, ``qk_descale`` their scales' product
        (q's scale 1.0: the estimator reads q's codes as its values, the kernel computes with both)."""
        cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
        p = plan(q if k8 is None else q.to(k.dtype), k, cu_q, cu_k, self.config, layer=layer, scale=scale)
        return self.run(layer, p, q, k if k8 is None else k8, v, qk_descale)

    def run(self, layer: int, p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            qk_descale: float = 1.0) -> torch.Tensor:
        """The kernel on ``plan``'s blocks -> [Tq, Hq, D] (the benches' adapter runs a fixed mask here)."""
        return p.run(q, k, v, qk_descale=qk_descale)[0]

"""Block-sparse causal attention for long prefill: estimator + Triton kernel, plan/run API.

    from prefill_server.kernels.block_sparse import SparseConfig, plan
    p = plan(q, k, cu_seqlens_q, cu_seqlens_k, SparseConfig(), layer=i)
    out, lse = p.run(q, k, v)

Importing this package needs only torch; Triton is imported when a Triton backend first runs.
"""
from .api import Plan, SparseConfig, indices_to_mask, mask_to_indices, plan, plan_from_mask
from .layout import Layout, build_layout

__all__ = ["Plan", "SparseConfig", "Layout", "build_layout", "plan", "plan_from_mask",
           "mask_to_indices", "indices_to_mask"]

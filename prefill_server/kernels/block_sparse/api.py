"""Plan/run API of block-sparse causal attention (FlashInfer style).

    cfg = SparseConfig()                                  # defaults chosen from measurements
    p = plan(q, k, cu_seqlens_q, cu_seqlens_k, cfg, layer=i)  # estimation + block indices, on device
    out, lse = p.run(q, k, v)                             # attention over exactly those blocks

q [Tq, Hq, D], k/v [Tk, Hkv, D] packed varlen; ``cu_seqlens_*`` int32 [B+1] on q's device; per
sequence q_len <= k_len and the queries are the last q_len key positions (chunked prefill).
``plan`` never synchronises with the host and never sorts (all shapes derive from tensor shapes).
Backends: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (``reference.py``, any device);
"auto" picks triton on CUDA and torch elsewhere. Triton is imported only when used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .layout import Layout, build_layout, slot_geometry
from . import reference


@dataclass(frozen=True)
class SparseConfig:
    """Knobs of the estimator and the dispatch. Defaults and the measurements behind them:
    docs/kernels-notes.md ("Choosing the defaults")."""

    block_size: int = 128  # query/key block edge (tokens): the kernel's mask granularity
    threshold: float = 0.001  # keep key block c if group score(c) >= threshold * mean row max
    #                           (SmolLM2, 8K, GPL text, top-1 agreement with dense: 0.03 -> 97.3%,
    #                           0.01 -> 98.4%, 0.003 -> 98.8%, 0.001 -> 99.2% with probe 0.002)
    q_pool: int = 32  # queries mean-pooled per score row (same accuracy as 16 and 64 on SmolLM2;
    #                   estimator 1.30 ms at 128K vs 1.38 ms for 16)
    sink_blocks: int = 1  # first key blocks always kept
    local_blocks: int = 4  # key blocks right before the diagonal region always kept (1 / 2 / 4
    #                        on SmolLM2 at 4K: missed attention mass 4.8% / 3.9% / 2.7%)
    last_q_blocks: int = 1  # last query blocks of each sequence computed dense
    probe_queries: int = 64  # last queries scored exactly against all keys (0: no probe; 128
    #                          instead of 64 at 4K: missed mass 0.062% vs 0.064%)
    probe_threshold: float = 0.0005  # keep a block for all queries if a head's probe mass >= this
    #                                  (probe off: 14.5% of the attention mass missed on SmolLM2;
    #                                  8K top-1 on 4 texts: 0.002 -> 97.7-100%, 2 of 4 >= 99%;
    #                                  0.0005 -> 99.2-100%, all 4, mean density 0.64 -> 0.68)
    dense_len_threshold: int = 8192  # sequences with fewer keys run dense (H200, 8B shape: at 8K
    #                                  estimator + kernel is only 1.2x faster than cuDNN; 16K: 3.7x)
    dense_first_layers: int = 1  # layers [0, n) are computed dense, on sequences of at most
    #                              dense_first_layers_max_len keys
    dense_first_layers_max_len: int = 262144  # longer sequences run the first layers sparse too (H200,
    #   8B shape: a dense layer 0 is 0.25 s at 128K but ~15.7 s at 1M, where the bar is 45 s and every
    #   layer sparse at 2% gave 36.5-37.3 s; SmolLM2 at 8K: the estimator keeps all of layer 0, and
    #   layer 0 forced to 25-40% density keeps top-1 at 97.7-100%: docs/kernels-notes.md, "A sparse
    #   first layer on long prompts")
    backend: str = "auto"  # "auto" | "triton" | "torch"

    def __post_init__(self):
        bs = self.block_size
        if bs < 16 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {bs}")
        if self.q_pool < 1 or bs % self.q_pool or self.q_pool & (self.q_pool - 1):
            raise ValueError(f"q_pool must be a power of two dividing block_size, got {self.q_pool}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.probe_queries < 0 or (self.probe_queries and (self.probe_queries < 16 or
                                                              self.probe_queries & (self.probe_queries - 1))):
            raise ValueError(f"probe_queries must be 0 or a power of two >= 16, got {self.probe_queries}")
        for name in ("sink_blocks", "local_blocks", "last_q_blocks", "dense_len_threshold",
                     "dense_first_layers", "dense_first_layers_max_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend must be auto, triton or torch, got {self.backend!r}")

    def first_dense_layers(self, k_len: int | None) -> int:
        """How many first layers run dense on a sequence of ``k_len`` keys: ``dense_first_layers`` up to
        ``dense_first_layers_max_len`` keys, none above. ``k_len`` None (length not known on the host,
        e.g. a packed batch of several sequences): ``dense_first_layers``."""
        if k_len is None or k_len <= self.dense_first_layers_max_len:
            return self.dense_first_layers
        return 0

    def dense_for(self, layer: int | None, k_len: int | None) -> bool:
        """Whether ``layer``'s attention over a sequence of ``k_len`` keys runs dense: fewer keys than
        ``dense_len_threshold``, or one of ``first_dense_layers(k_len)``. ``layer`` None: no layer rule."""
        if k_len is not None and k_len < self.dense_len_threshold:
            return True
        return layer is not None and layer < self.first_dense_layers(k_len)


def _backend(cfg: SparseConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "triton" if device.type == "cuda" else "torch"


def mask_to_indices(sel: torch.Tensor, layout: Layout):
    """Compact a slot-space block mask (bool [n_slots, Hkv, max_kblocks]) into (idx, cnt), keeping
    only selectable blocks (j < diag_lo), ascending, with a prefix sum (no sort, no host sync)."""
    lo, _, valid = slot_geometry(layout)
    col = torch.arange(sel.shape[-1], device=sel.device)
    keep = sel & (col[None, None, :] < lo[:, None, None]) & valid[:, None, None]
    cap = sel.shape[-1]
    pos = torch.cumsum(keep.to(torch.int32), -1) - 1
    pos = torch.where(keep, pos, cap).long()  # unkept entries land in a dummy column, dropped below
    idx = torch.zeros(*sel.shape[:-1], cap + 1, dtype=torch.int32, device=sel.device)
    idx.scatter_(-1, pos, col.to(torch.int32).expand(sel.shape).contiguous())
    cnt = keep.sum(-1, dtype=torch.int32)
    return idx[..., :cap].contiguous(), cnt


def indices_to_mask(idx: torch.Tensor, cnt: torch.Tensor) -> torch.Tensor:
    """Inverse of ``mask_to_indices``: bool [n_slots, Hkv, max_kblocks]."""
    cap = idx.shape[-1]
    sel = torch.zeros(*idx.shape[:-1], cap + 1, dtype=torch.bool, device=idx.device)
    live = torch.arange(cap, device=idx.device)[None, None, :] < cnt[..., None]
    sel.scatter_(-1, torch.where(live, idx, cap).long(), live)  # dead entries -> dummy column
    return sel[..., :cap].contiguous()


@dataclass
class Plan:
    """Result of ``plan``: which blocks ``run`` computes. ``dense`` plans visit every causal block."""

    layout: Layout
    config: SparseConfig
    backend: str
    num_kv_heads: int
    scale: float | None = None  # None: 1/sqrt(head_dim)
    dense: bool = False
    idx: torch.Tensor | None = None  # int32 [n_slots, Hkv, max_kblocks]
    cnt: torch.Tensor | None = None  # int32 [n_slots, Hkv]
    _sel: torch.Tensor | None = field(default=None, repr=False)
    _sched: dict = field(default_factory=dict, repr=False)  # persistent-kernel schedules, per tiling

    @property
    def block_mask(self) -> torch.Tensor:
        """Slot-space bool mask of the selectable blocks kept (diagonal region implied)."""
        if self._sel is None:
            if self.dense:
                self._sel = torch.ones(self.layout.n_slots, self.num_kv_heads, self.layout.max_kblocks,
                                       dtype=torch.bool, device=self.layout.device)
            else:
                self._sel = indices_to_mask(self.idx, self.cnt)
        return self._sel

    def density(self) -> float:
        """Computed causal blocks (selected + diagonal) / all causal blocks. Syncs with the host."""
        if self.dense:
            return 1.0
        return reference.density(self.block_mask, self.layout)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, qk_descale: float = 1.0):
        """-> (out [Tq, Hq, D] v.dtype, lse [Tq, Hq] float32, natural log). ``out``/``lse``: optional
        preallocated outputs (triton backend writes them in place). q and k may be e4m3 codes whose
        dot products times ``qk_descale`` are the scores (``kernel.attention``'s FP8 scores)."""
        _check(q, k, v)
        if k.shape[1] != self.num_kv_heads:
            raise ValueError(f"plan was made for {self.num_kv_heads} KV heads, k has {k.shape[1]}")
        if self.backend == "torch":
            if q.dtype == torch.float8_e4m3fn:  # the codes' values: what the kernel computes with
                q, k = q.to(v.dtype) * qk_descale, k.to(v.dtype)
            sel = None if self.dense else self.block_mask
            o, l = (reference.dense_attention(q, k, v, self.layout, self.scale) if self.dense
                    else reference.attention(q, k, v, self.layout, sel, self.scale))
            if out is not None:
                out.copy_(o)
                o = out
            if lse is not None:
                lse.copy_(l)
                l = lse
            return o, l
        from . import kernel
        return kernel.attention(q, k, v, self.layout, self.idx, self.cnt, self.scale, dense=self.dense,
                                sched_cache=self._sched, out=out, lse=lse, qk_descale=qk_descale)


def _check(q, k, v=None):
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError("q must be [Tq, Hq, D] and k [Tk, Hkv, D]")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"head_dim must match and Hq must be a multiple of Hkv: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    d = q.shape[2]
    if d & (d - 1) or not 16 <= d <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {d}")


def plan(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
         config: SparseConfig | None = None, *, layer: int | None = None, layout: Layout | None = None,
         scale: float | None = None) -> Plan:
    """Estimate the blocks to compute and build per-(query block, KV head) indices on q's device.

    ``layer``: index of the layer (dense for ``layer < config.dense_first_layers`` up to
    ``config.dense_first_layers_max_len`` keys, see ``SparseConfig.dense_for``; a packed batch of
    several sequences keeps those layers dense, its longest sequence being unknown on the host);
    ``layout``: reuse the batch's ``build_layout(...)`` across layers; ``scale`` defaults to
    1/sqrt(head_dim)."""
    cfg = config or SparseConfig()
    _check(q, k)
    if layout is None:
        layout = build_layout(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], cfg.block_size)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    backend = _backend(cfg, q.device)
    dense = k.shape[0] < cfg.dense_len_threshold or cfg.dense_for(layer, k.shape[0] if layout.batch == 1 else None)
    p = Plan(layout, cfg, backend, k.shape[1], scale, dense=dense)
    if dense:
        return p
    if backend == "torch":
        p._sel = reference.estimate(q, k, layout, cfg, scale)
        p.idx, p.cnt = mask_to_indices(p._sel, layout)
    else:
        from . import estimate
        p.idx, p.cnt = estimate.select_blocks(q, k, layout, cfg, scale)
    return p


def plan_from_mask(sel: torch.Tensor, layout: Layout, config: SparseConfig | None = None,
                   scale: float | None = None) -> Plan:
    """A plan for a given slot-space block mask (fixed-mask benchmarks, tests)."""
    cfg = config or SparseConfig()
    p = Plan(layout, cfg, _backend(cfg, sel.device), sel.shape[1], scale, dense=False)
    p.idx, p.cnt = mask_to_indices(sel, layout)
    p._sel = sel
    return p

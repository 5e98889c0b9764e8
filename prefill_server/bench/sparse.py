"""The sparse adapter of the benches (``bench e2e stream``, ``bench e2e --throughput-densities``): the
engine's ``SparseAttention`` instrumented to record the estimator's density per layer, and able to
run a fixed mask of a given density instead of the estimator's selection (the estimator still
runs, so its cost stays in the time). ``sparse_config`` parses ``--sparse key=value,...``.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from prefill_server.bench.attention import fixed_mask
from prefill_server.kernels.block_sparse import SparseConfig, build_layout, plan_from_mask
from prefill_server.kernels.block_sparse.layout import slot_geometry
from prefill_server.layers.sparse import SparseAttention


class BenchSparse(SparseAttention):
    """The engine's sparse adapter plus: the estimator's density per layer, kept on the device (no
    host sync in the forward); with ``density`` set, the kernel runs a fixed mask of that density
    instead of the estimator's selection (the estimator still runs: its cost stays in the time)."""

    def __init__(self, config: SparseConfig | None = None, density: float | None = None, seed: int = 0):
        super().__init__(config)
        self.density, self.seed = density, seed
        self._fixed: dict[tuple[int, int], object] = {}  # (Tq, Tk) -> Plan on the fixed mask
        self._geo: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._kept: list[tuple[int, tuple[int, int], torch.Tensor]] = []
        self.mask_density: dict[int, float] = {}  # Tk -> achieved density of the fixed mask

    @property
    def label(self) -> str:
        return "estimator" if self.density is None else f"fixed-{self.density:g}"

    def prepare(self, tokens: int, num_kv_heads: int, head_dim: int, device) -> None:
        """Build the fixed mask for a whole prompt of ``tokens`` ahead of the timed runs."""
        if self.density is None or (tokens, tokens) in self._fixed:
            return
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        layout = build_layout(cu, cu, tokens, tokens, self.config.block_size)
        sel = fixed_mask(layout, num_kv_heads, self.density, self.seed)
        p = plan_from_mask(sel, layout, self.config, head_dim ** -0.5)
        self.mask_density[tokens] = p.density()
        self._fixed[(tokens, tokens)] = p

    def run(self, layer, p, q, k, v, qk_descale=1.0):
        if p.dense:
            return p.run(q, k, v, qk_descale=qk_descale)[0]
        key = (q.shape[0], k.shape[0])
        if key not in self._geo:
            lo, hi, valid = slot_geometry(p.layout)
            zero = torch.zeros_like(hi)
            self._geo[key] = (torch.where(valid, hi - lo + 1, zero).sum(), torch.where(valid, hi + 1, zero).sum(),
                              k.shape[1])
        self._kept.append((layer, key, p.cnt.sum()))
        if self.density is None:
            return p.run(q, k, v, qk_descale=qk_descale)[0]
        if key not in self._fixed:  # (not prepared: built here, inside the timed run)
            self.prepare(k.shape[0], k.shape[1], q.shape[2], q.device)
        return self._fixed[key].run(q, k, v, qk_descale=qk_descale)[0]

    def take_densities(self) -> dict:
        """Estimator density per sparse layer of the last run(s): computed causal blocks (kept +
        diagonal) / all causal blocks, over KV heads. Syncs; clears the record."""
        per = []
        for layer, key, kept in self._kept:
            diag, tot, hkv = self._geo[key]
            per.append((layer, float((kept + hkv * diag) / (hkv * tot))))
        self._kept.clear()
        vals = [d for _, d in per]
        return {"mean": statistics.fmean(vals) if vals else None, "min": min(vals, default=None),
                "max": max(vals, default=None), "per_layer": per}


def sparse_config(overrides: str) -> SparseConfig:
    kw = {}
    fields = {f.name: f.type for f in dataclasses.fields(SparseConfig)}
    for item in filter(None, (s.strip() for s in overrides.split(","))):
        k, v = item.split("=")
        if k not in fields:
            raise SystemExit(f"--sparse: unknown SparseConfig field {k!r}")
        kw[k] = v if k == "backend" else (float(v) if "." in v or "e" in v else int(v))
    return SparseConfig(**kw)

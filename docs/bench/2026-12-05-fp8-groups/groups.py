"""Do finer FP8 scales bring SmolLM2-135M's FP8 projections near bf16 (issue 20)? One-off, CPU.

Adds to ``docs/bench/2026-12-04-fp8-accuracy/floor.py`` (same texts, positions, metrics and bf16
rounding of everything around the projections) the variants ``grp_<A>_<W>``: activations quantized
to e4m3 with one scale per row and group of A input columns, weights with one scale per output row
and group of W input columns (0: the whole row, i.e. today's per-token / per-channel scheme), exact
float32 sums of the dequantized operands. From the repository root:

    .venv/bin/python docs/bench/2026-12-05-fp8-groups/groups.py --tokens 512 --last 128 \
        --variants fp32,bf16,fp8,grp_0_0,grp_64_0,grp_64_64,grp_32_32 --texts gpl3,held_out --out result_512.json
"""
from __future__ import annotations

import copy
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "2026-12-04-fp8-accuracy"))
import floor  # noqa: E402

from prefill_server.layers import fp8  # noqa: E402
from prefill_server.layers.linear import add_residual  # noqa: E402


def quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [R, C] rounded through e4m3 with one scale per (row, group of ``group`` columns), dequantized."""
    r, c = x.shape
    xg = x.float().reshape(r, c // group, group)
    s = (xg.abs().amax(-1, keepdim=True) * fp8.INV_FP8_MAX).clamp(min=fp8.MIN_SCALE)
    return ((xg / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8).float() * s).reshape(r, c)


class GroupLinear(torch.nn.Module):
    """A projection with group-scaled FP8 operands (emulated), the methods the model calls."""

    def __init__(self, lin: torch.nn.Module, act_group: int, weight_group: int):
        super().__init__()
        w = lin.weight.detach().float()
        self.w = quantize_groups(w, weight_group) if weight_group else fp8.Fp8Linear.from_linear(lin).dequantized()
        self.bias, self.act_group = lin.bias, act_group
        self.output_sizes = getattr(lin, "output_sizes", [self.w.shape[0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.act_group:
            xd = quantize_groups(x2, self.act_group)
        else:
            q, s = fp8.quantize_rows_reference(x2)
            xd = q.float() * s
        y = xd @ self.w.t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(self.forward(x), self.output_sizes, dim=-1)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return add_residual(residual, self.forward(x), out)


def build(name: str, base):
    if not name.startswith("grp_"):
        return plain_build(name, base)
    _, act_group, weight_group = name.split("_")
    m = copy.deepcopy(base)
    for layer in m.model.layers:
        for parent, proj in fp8.PROJECTIONS:
            owner = getattr(layer, parent)
            setattr(owner, proj, GroupLinear(getattr(owner, proj), int(act_group), int(weight_group)))
    for mod in m.modules():  # outputs and the residual stream rounded to bf16, as floor.py's fp8
        if isinstance(mod, GroupLinear):
            mod.register_forward_hook(floor._round_out)
    for layer in m.model.layers:
        layer.register_forward_hook(floor._round_out)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.register_forward_hook(floor._round_out)
    return m, floor.RoundedDense(record=True)


plain_build = floor.build
floor.build = build

if __name__ == "__main__":
    sys.exit(floor.main())

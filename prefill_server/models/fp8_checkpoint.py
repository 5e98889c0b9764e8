"""FP8 checkpoints in the formats vLLM loads, read into ``layers.fp8.Fp8Linear``.

Two formats, both e4m3 weights ``[out, in]`` beside a float32 ``weight_scale`` (W = codes x scale):
- ``compressed-tensors`` ("float-quantized", what llm-compressor's FP8 and FP8_DYNAMIC schemes
  write, e.g. the Hub's ``*-FP8-dynamic`` models): a scale per output channel (``[out, 1]``,
  strategy "channel") or one per tensor (strategy "tensor");
- vLLM's own ``fp8`` (``quant_method: fp8``, e.g. AutoFP8's): one scale per tensor.

Per-tensor scales become per-row ones (every row of the tensor gets it), so q|k|v and gate|up fuse
into one ``Fp8Linear`` each, as with ``--quantization fp8`` on a bf16 checkpoint. Activations are
quantized per token at run time whatever the checkpoint says (its static ``input_scale``s are not
read): only the KV this server writes depends on it, never the decode's weights. Block-wise scales
(``weight_block_size``, DeepSeek's ``weight_scale_inv``), group scales and integer formats are
refused at start-up, naming what the checkpoint has.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale"  # weight -> weight_scale, in both formats


@dataclass(frozen=True)
class Fp8Checkpoint:
    method: str  # "compressed-tensors" | "fp8"
    strategy: str  # "channel" | "tensor": how the weights' scales are laid out


def read_config(config: dict) -> Fp8Checkpoint | None:
    """The checkpoint's ``quantization_config`` (from config.json) if it is an FP8 one we read; None
    for an unquantized checkpoint; ``ValueError`` naming the scheme for any other."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(f"this FP8 checkpoint has block-wise scales (weight_block_size "
                             f"{qc['weight_block_size']}), which this prefill server does not read; use a "
                             "per-channel or per-tensor FP8 checkpoint, or the bf16 one with --quantization fp8")
        return Fp8Checkpoint("fp8", "tensor")
    if method == "compressed-tensors":
        return Fp8Checkpoint("compressed-tensors", _compressed_tensors_strategy(qc))
    raise ValueError(f"the checkpoint is quantized with {method!r}; this prefill server reads FP8 checkpoints "
                     "(compressed-tensors float-quantized, or quant_method fp8) and unquantized ones")


def _compressed_tensors_strategy(qc: dict) -> str:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("the compressed-tensors checkpoint has no config_groups: cannot tell how it is quantized")
    strategies = set()
    for g in groups:
        w = g.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("symmetric", True)) != (8, "float", True):
            raise ValueError(f"the compressed-tensors checkpoint's weights are {w.get('num_bits')}-bit "
                             f"{w.get('type')} (symmetric {w.get('symmetric')}): this prefill server reads "
                             "8-bit float (FP8) weights only")
        if w.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"the compressed-tensors checkpoint's weight scales are per {w.get('strategy')}: "
                             "this prefill server reads per-channel and per-tensor FP8 scales only")
        strategies.add(w["strategy"])
    return "channel" if "channel" in strategies else "tensor"


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A weight's scale (``[out, 1]``, ``[out]``, ``[1]`` or ``[]``) as one float32 scale per row [out]."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ValueError(f"a weight of {rows} rows has {s.numel()} scales: neither per channel nor per tensor")
    return s


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [out, in] e4m3 x its scale -> [out, in] in ``dtype`` (for ``--quantization none``)."""
    return (codes.float() * row_scales(scale, codes.shape[0])[:, None]).to(dtype)

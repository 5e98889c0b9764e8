"""How KV pages are stored: in the model's dtype, or in FP8 for a decode that runs
``--kv-cache-dtype fp8`` (vLLM).

A decode reads our pages as if it had written them itself, so FP8 pages must hold what vLLM's
own cache write stores: ``x / scale`` converted to e4m3 with saturation (CUDA's
``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3)``, the Triton write's store, and
``QuantFP8.forward_native``: out-of-range values become +-448, not NaN), rounded to nearest even,
one scale per tensor. vLLM's scales are 1.0 unless the checkpoint carries calibrated ones
(``k_scale`` / ``v_scale`` tensors), so ours are 1.0 and a checkpoint with its own is refused
(``kv_scales_in``). The bytes are one per value: half of bf16's to hold and to send.

The names are vLLM's ``--kv-cache-dtype`` values; "fp8" is "fp8_e4m3" (vLLM's alias). fp8_e5m2
is not offered: no vLLM code runs it on this project's CPU test machines to test against.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from prefill_server.config import KV_CACHE_DTYPES
from prefill_server.layers.fp8 import to_e4m3
_STORAGE = {"fp8_e4m3": torch.float8_e4m3fn}
_ALIASES = {"fp8": "fp8_e4m3"}
# a vLLM cache dtype naming the model's own dtype is the same bytes as "auto"
_NATIVE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
           "float32": torch.float32, "float": torch.float32}
_SCALE_NAME = re.compile(r"\.(k_scale|v_scale|kv_scale)$|\.(k_proj|v_proj)\.output_scale$")


def canonical(cache_dtype: str, model_dtype: torch.dtype) -> str:
    """A decode's ``--kv-cache-dtype`` as the format its pages have: "auto" (the model's dtype),
    "fp8_e4m3", or the name itself when it is neither (a format we do not write)."""
    name = _ALIASES.get(cache_dtype, cache_dtype)
    if name == "auto" or _NATIVE.get(name) == model_dtype:
        return "auto"
    return name


def kv_scales_in(tensor_names) -> list[str]:
    """Checkpoint tensors that are KV-cache scales (vLLM loads them as the decode's k/v scale)."""
    return [n for n in tensor_names if _SCALE_NAME.search(n)]


@dataclass(frozen=True)
class KVFormat:
    """cache_dtype: canonical (``canonical``); compute_dtype: what K/V are computed and read in."""

    cache_dtype: str
    compute_dtype: torch.dtype
    k_scale: float = 1.0
    v_scale: float = 1.0

    @classmethod
    def of(cls, cache_dtype: str, compute_dtype: torch.dtype) -> KVFormat:
        name = canonical(cache_dtype, compute_dtype)
        if name != "auto" and name not in _STORAGE:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {cache_dtype!r}")
        return cls(name, compute_dtype)

    @property
    def quantized(self) -> bool:
        return self.cache_dtype != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        return _STORAGE.get(self.cache_dtype, self.compute_dtype)

    def store(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x (any float dtype) -> the page's values: a cast, or vLLM's saturating FP8 quantization."""
        if not self.quantized:
            return x.to(self.compute_dtype)
        return to_e4m3(x, scale)  # (e4m3: the only FP8 storage offered)

    def load(self, pages: torch.Tensor, scale: float) -> torch.Tensor:
        """Page values -> compute dtype (FP8: times the scale, as the decode's attention reads them)."""
        if not self.quantized:
            return pages
        x = pages.to(self.compute_dtype)
        return x if scale == 1.0 else x * scale

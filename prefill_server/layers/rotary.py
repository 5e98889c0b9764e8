"""Rotary position embedding in the Hugging Face ``rotate_half`` convention (the first and second
halves of each head form the rotated pairs), with optional Llama 3.1 frequency scaling.

cos/sin are computed per call from a positions tensor, so a flattened batch of several sequences
(each with its own offsets) needs no cache of its own."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # no runtime import: models imports layers
    from prefill_server.models.config import Llama3RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: "Llama3RopeScaling | None" = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, bit-identical to transformers'."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    s = scaling
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds the inverse frequencies (one float32 copy per device); no parameters, no buffers,
    so a model built on the meta device needs nothing re-materialized."""

    def __init__(self, head_dim: int, theta: float, scaling: "Llama3RopeScaling | None" = None):
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.head_dim, self.theta, self.scaling, device)
        return self._inv_freq[device]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int -> (cos, sin), each [T, head_dim] in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq(positions.device)  # [T, head_dim/2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim] -> [T, heads, head_dim]. Computed in float32
    and rounded once, as vLLM's rotary kernels (and our fused CUDA kernel) do."""
    cos = cos[:, None, :].float()
    sin = sin[:, None, :].float()
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

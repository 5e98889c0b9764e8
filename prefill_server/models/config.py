"""Model configuration: one frozen dataclass for the Llama family (Llama, Mistral, Qwen2, Qwen3),
read from a Hugging Face ``config.json`` (transformers 4.x or 5.x layout)."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import torch

# HF ``architectures[0]`` -> our architecture name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_DTYPES = {
    "float32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """'bfloat16' / 'torch.bfloat16' / torch.bfloat16 -> torch.bfloat16; None -> default."""
    if value is None:
        return default
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (HF ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # may differ from hidden_size // num_heads (Qwen3)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2; Llama/Qwen3 when attention_bias=true)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    sliding_window: int | None  # recorded only; the attention backend decides what to do with it
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_proj_bias: bool = False  # Llama/Qwen3 attention_bias also puts a bias on o_proj
    mlp_bias: bool = False  # Llama mlp_bias

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"unknown architecture {self.architecture!r}; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES.values())}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> "ModelConfig":
        """Read ``config.json`` (and eos ids from ``generation_config.json`` if present)."""
        path = pathlib.Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path} has no config.json; expected a Hugging Face model folder")
        d = json.loads(cfg_file.read_text())
        gen_file = path / "generation_config.json"
        extra_eos: list[int] = []
        if gen_file.is_file():
            extra_eos = _as_int_list(json.loads(gen_file.read_text()).get("eos_token_id"))
        cfg = cls.from_dict(d)
        eos = list(cfg.eos_token_ids) + [e for e in extra_eos if e not in cfg.eos_token_ids]
        return dataclasses.replace(cfg, eos_token_ids=tuple(eos))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architectures {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        head_dim = d.get("head_dim") or hidden // num_heads
        theta, scaling = _parse_rope(d)
        bias = bool(d.get("attention_bias", False))
        sliding = d.get("sliding_window")
        if arch in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window size that is off unless use_sliding_window
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bias,
            o_proj_bias=bias if arch in ("llama", "qwen3") else False,
            mlp_bias=bool(d.get("mlp_bias", False)) if arch == "llama" else False,
            qk_norm=arch == "qwen3",
            sliding_window=sliding,
            dtype=parse_dtype(d.get("torch_dtype") or d.get("dtype")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(_as_int_list(d.get("eos_token_id"))),
        )


def _as_int_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _parse_rope(d: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """transformers 4.x: ``rope_theta`` + ``rope_scaling``; 5.x: ``rope_parameters`` holding both."""
    params = dict(d.get("rope_parameters") or {})
    if "rope_theta" in params and isinstance(params.get("rope_theta"), dict):
        raise ValueError("per-layer-type rope_parameters are not supported")
    scaling = d.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: 'default', 'llama3'")
    try:
        return theta, Llama3RopeScaling(
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings") or d["max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling is missing {e.args[0]!r}") from None

"""Load a Hugging Face safetensors checkpoint (single file or sharded) into ``LlamaForCausalLM``.

The module is built on the meta device and each parameter is materialized once, straight from the
safetensors file onto ``device`` in the requested dtype; q/k/v and gate/up are concatenated into
the fused projections here."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib

import torch
from safetensors import safe_open

from prefill_server.models import fp8_checkpoint
from prefill_server.models.config import ModelConfig, parse_dtype
from prefill_server.models.llama import FUSED_PARAMS, LlamaForCausalLM


def safetensors_index(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files (only safetensors checkpoints are supported)")
    out: dict[str, pathlib.Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            out.update({name: f for name in fh.keys()})
    return out


def _checkpoint_names(param: str) -> list[str]:
    """Our parameter name -> the checkpoint tensors concatenated (dim 0) to form it."""
    for fused, parts in FUSED_PARAMS.items():
        if f".{fused}." in param:
            return [param.replace(f".{fused}.", f".{p}.") for p in parts]
    return [param]


def checkpoint_fp8(path: str | pathlib.Path) -> fp8_checkpoint.Fp8Checkpoint | None:
    """The folder's FP8 format (``fp8_checkpoint.read_config`` of its config.json), None if unquantized."""
    return fp8_checkpoint.read_config(json.loads((pathlib.Path(path) / "config.json").read_text()))


def load_model(path: str | pathlib.Path, dtype: str | torch.dtype | None = None,
               device: str | torch.device = "cpu", fp8_projections: bool = False) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Read ``config.json`` + safetensors from ``path``; dtype defaults to the config's torch_dtype.
    An FP8 checkpoint (``fp8_checkpoint``): with ``fp8_projections`` the decoder layers' projections
    become ``Fp8Linear`` straight from its codes and scales (no bf16 copy is ever made); without,
    every FP8 tensor is dequantized into ``dtype``."""
    path = pathlib.Path(path)
    cfg = ModelConfig.from_hf_dir(path)
    cfg = dataclasses.replace(cfg, dtype=parse_dtype(dtype, default=cfg.dtype))
    index = safetensors_index(path)
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in index
    if tied and not cfg.tie_word_embeddings:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    device = torch.device(device)
    state: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt", device=str(device)))
                   for f in set(index.values())}

        def raw(name: str) -> torch.Tensor:
            if name not in index:
                raise ValueError(f"checkpoint {path} is missing tensor {name!r} needed by {cfg.architecture}")
            return handles[index[name]].get_tensor(name)

        def read(name: str) -> torch.Tensor:
            t = raw(name)
            if fp8_checkpoint.is_fp8(t):
                return fp8_checkpoint.dequantize(t, raw(name + fp8_checkpoint.SCALE_SUFFIX), cfg.dtype)
            return t.to(cfg.dtype)

        fp8_modules = _fp8_projections(model, raw, read, cfg.dtype) if fp8_projections else ()
        for name, param in model.named_parameters():  # tied lm_head appears once, as embed_tokens
            if name.startswith(fp8_modules):
                continue
            parts = [read(n) for n in _checkpoint_names(name)]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            del parts
            if tensor.shape != param.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
            state[name] = tensor
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    for name, p in model.named_parameters():
        assert p.device == device and (p.dtype == cfg.dtype or name.startswith(fp8_modules)), (name, p.device, p.dtype)
    return cfg, model.eval()


def _fp8_projections(model: LlamaForCausalLM, raw, read, dtype: torch.dtype) -> tuple[str, ...]:
    """Every decoder layer's projections as ``Fp8Linear`` of the checkpoint's codes (q|k|v and gate|up
    concatenated, their scales one per row); returns their parameter-name prefixes."""
    from prefill_server.layers.fp8 import ALIGN, PROJECTIONS, Fp8Linear

    done = []
    for i, layer in enumerate(model.model.layers):
        for parent, attr in PROJECTIONS:
            owner = getattr(layer, parent)
            lin = getattr(owner, attr)
            prefix = f"model.layers.{i}.{parent}.{attr}."
            parts = _checkpoint_names(prefix + "weight")
            codes = [raw(n) for n in parts]
            if not all(fp8_checkpoint.is_fp8(c) for c in codes):
                raise ValueError(f"{parts[0]} is {codes[0].dtype} in an FP8 checkpoint: this prefill server reads "
                                 "checkpoints whose decoder projections are all FP8")
            scales = [fp8_checkpoint.row_scales(raw(n + fp8_checkpoint.SCALE_SUFFIX), c.shape[0])
                      for n, c in zip(parts, codes)]
            weight = codes[0] if len(codes) == 1 else torch.cat(codes)
            if tuple(weight.shape) != tuple(lin.weight.shape):
                raise ValueError(f"{prefix}weight: checkpoint shape {tuple(weight.shape)} != expected "
                                 f"{tuple(lin.weight.shape)}")
            if weight.shape[0] % ALIGN or weight.shape[1] % ALIGN:
                raise ValueError(f"{prefix}weight {tuple(weight.shape)} is not a multiple of {ALIGN} in both "
                                 "dimensions, which FP8 GEMMs need; use --quantization none (dequantized)")
            bias = None
            if lin.bias is not None:
                bias = torch.cat([read(n) for n in _checkpoint_names(prefix + "bias")])
            setattr(owner, attr, Fp8Linear(weight, torch.cat(scales), bias, getattr(lin, "output_sizes", None), dtype))
            done.append(prefix)
    return tuple(done)

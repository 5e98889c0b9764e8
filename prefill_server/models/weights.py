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


def load_model(path: str | pathlib.Path, dtype: str | torch.dtype | None = None,
               device: str | torch.device = "cpu") -> tuple[ModelConfig, LlamaForCausalLM]:
    """Read ``config.json`` + safetensors from ``path``; dtype defaults to the config's torch_dtype."""
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

        def read(name: str) -> torch.Tensor:
            if name not in index:
                raise ValueError(f"checkpoint {path} is missing tensor {name!r} needed by {cfg.architecture}")
            return handles[index[name]].get_tensor(name).to(cfg.dtype)

        for name, param in model.named_parameters():  # tied lm_head appears once, as embed_tokens
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
        assert p.device == device and p.dtype == cfg.dtype, (name, p.device, p.dtype)
    return cfg, model.eval()

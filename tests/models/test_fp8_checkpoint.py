"""FP8 checkpoints (models/fp8_checkpoint.py): the embedded SmolLM2 written as compressed-tensors
(per channel, per tensor) and as vLLM's ``fp8`` format, in the tensor names, shapes and dtypes
vLLM's own quantization schemes declare for them (``vllm_reference.py fp8_ckpt``), then loaded.

A per-channel checkpoint made with the same rounding as ``--quantization fp8`` loads into the same
codes and scales (so the same logits) as converting the bf16 checkpoint at load; ``--quantization
none`` dequantizes it; schemes we do not read are refused naming what the checkpoint has.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.layers.fp8 import Fp8Linear, quantize_rows_reference
from prefill_server.models.fp8_checkpoint import read_config
from prefill_server.models.registry import resolve_model
from tests.kv_transfer.test_v0_32_wire import needs_vllm, run_reference

PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")


def compressed_tensors_config(strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                              "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                                          "dynamic": False},
                              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                    "symmetric": True, "dynamic": True}}}}


def write_fp8_checkpoint(dst, quantization_config: dict, per_channel: bool):
    """The embedded model's folder with every decoder projection in e4m3: per channel as
    ``--quantization fp8`` rounds (absmax / 448 per row), or one scale per tensor."""
    src = resolve_model(None)
    shutil.copytree(src, dst)
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if name.endswith(".weight") and any(f".{p}." in name for p in PARTS):
                if per_channel:
                    q, s = quantize_rows_reference(t)  # [out, in] e4m3, [out, 1] float32
                else:
                    s = (t.float().abs().max() / 448.0).reshape(1)
                    q = (t.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
                tensors[name], tensors[name[:-len(".weight")] + ".weight_scale"] = q, s.float()
            else:
                tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def channel_dir(tmp_path_factory):
    return write_fp8_checkpoint(tmp_path_factory.mktemp("ct") / "m", compressed_tensors_config("channel"), True)


def projections(model):
    for layer in model.model.layers:
        yield layer.self_attn.qkv_proj
        yield layer.self_attn.o_proj
        yield layer.mlp.gate_up_proj
        yield layer.mlp.down_proj


def logits(m, ids):
    from prefill_server.models.reference_attention import CausalAttention

    with torch.inference_mode():
        return m.model(torch.tensor(ids), torch.arange(len(ids)), CausalAttention.single(len(ids)),
                       torch.tensor([len(ids) - 1]))[0]


def test_the_test_checkpoint_is_what_vllm_declares(channel_dir, tmp_path):
    """vLLM's compressed-tensors and fp8 schemes, asked for each projection's parameters, name the
    tensors our checkpoints hold, with their shapes and dtypes."""
    needs_vllm()
    tensor_dir = write_fp8_checkpoint(tmp_path / "t", compressed_tensors_config("tensor"), False)
    fp8_dir = write_fp8_checkpoint(tmp_path / "f", {"quant_method": "fp8", "activation_scheme": "dynamic"}, False)
    for d in (channel_dir, tensor_dir, fp8_dir):
        cfg = json.loads((d / "config.json").read_text())
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            ours = {n: (list(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}
        layers = [{"name": f"model.layers.0.{p}", "in": ours[f"model.layers.0.{p}.weight"][0][1],
                   "out": ours[f"model.layers.0.{p}.weight"][0][0]} for p in PARTS]
        got = json.loads(run_reference("fp8_ckpt", json.dumps(
            {"quantization_config": cfg["quantization_config"], "layers": layers}).encode()))
        for layer in layers:
            declared = got[layer["name"]]
            assert set(declared) == {"weight", "weight_scale"}, declared  # (dynamic activations: no input_scale)
            for param, (shape, dtype) in declared.items():
                mine_shape, mine_dtype = ours[f"{layer['name']}.{param}"]
                assert mine_shape == shape or (param == "weight_scale" and _numel(mine_shape) == _numel(shape) == 1), \
                    (d.name, layer["name"], param, mine_shape, shape)
                assert {"F8_E4M3": "torch.float8_e4m3fn", "F32": "torch.float32"}[mine_dtype] == dtype


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_per_channel_checkpoint_loads_as_conversion_at_load_would(channel_dir):
    fp8 = build.load(EngineConfig(model=str(channel_dir), dtype="bfloat16", device="cpu"))  # auto
    conv = build.load(EngineConfig(dtype="bfloat16", device="cpu", quantization="fp8"))
    assert fp8.quantization == "fp8"
    for a, b in zip(projections(fp8.model), projections(conv.model)):
        assert isinstance(a, Fp8Linear) and a.output_sizes == b.output_sizes
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
        assert torch.equal(a.weight_scale, b.weight_scale)
    ids = fp8.tokenizer.encode("The capital of France is")
    assert torch.equal(logits(fp8, ids), logits(conv, ids))


def test_none_dequantizes_and_per_tensor_scales_apply_to_every_row(channel_dir, tmp_path):
    plain = build.load(EngineConfig(model=str(channel_dir), dtype="bfloat16", device="cpu", quantization="none"))
    assert plain.quantization == "none"
    layer = plain.model.model.layers[3].self_attn.qkv_proj
    assert not isinstance(layer, Fp8Linear) and layer.weight.dtype == torch.bfloat16
    with safe_open(str(channel_dir / "model.safetensors"), framework="pt") as f:
        q, s = f.get_tensor("model.layers.3.self_attn.q_proj.weight"), f.get_tensor("model.layers.3.self_attn.q_proj.weight_scale")
    assert torch.equal(layer.weight[:q.shape[0]], (q.float() * s).to(torch.bfloat16))
    tensor_dir = write_fp8_checkpoint(tmp_path / "t", {"quant_method": "fp8", "activation_scheme": "dynamic"}, False)
    m = build.load(EngineConfig(model=str(tensor_dir), dtype="bfloat16", device="cpu"))
    with safe_open(str(tensor_dir / "model.safetensors"), framework="pt") as f:
        q, s = f.get_tensor("model.layers.0.mlp.down_proj.weight"), f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
    down = m.model.model.layers[0].mlp.down_proj
    assert torch.equal(down.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(down.weight_scale.reshape(-1), s.expand(q.shape[0]))
    ids = m.tokenizer.encode("The capital of France is")
    assert torch.isfinite(logits(m, ids)).all()


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise scales"),
    ({"quant_method": "awq"}, "quantized with 'awq'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}},
     "8-bit int"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "group"}}}}, "per group"),
])
def test_schemes_we_do_not_read_are_named(qc, match):
    assert read_config({}) is None
    with pytest.raises(ValueError, match=match):
        read_config({"quantization_config": qc})

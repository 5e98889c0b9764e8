"""Run vLLM 0.32's own NIXL connector code (in .venv-vllm, never imported by our tests).

    .venv-vllm/bin/python tests/kv_transfer/vllm_reference.py hash < cases.json
        stdin: a JSON list of factor dicts (keys of ``compatibility_factors``); stdout: the hashes
        ``vllm...nixl.metadata.compute_nixl_compatibility_hash`` computes for a config with them.
    .venv-vllm/bin/python tests/kv_transfer/vllm_reference.py decode < payload.bin
        stdin: a side-channel reply frame; stdout: JSON of the NixlHandshakePayload and the
        NixlAgentMetadata vLLM's decoders read from it (bytes fields as hex).
    .venv-vllm/bin/python tests/kv_transfer/vllm_reference.py encode < metadata.json
        stdin: JSON NixlAgentMetadata fields (bytes as hex); stdout: hex of vLLM's own msgpack.
    .venv-vllm/bin/python tests/kv_transfer/vllm_reference.py fp8_kv < case.json
        stdin: {"values": hex of float32 values, "scale": s, "cache_dtype": "fp8", "model_dtype":
        "bfloat16", "block_size": N, "num_kv_heads": H, "head_size": D}; stdout: {"codes": hex of the
        e4m3 bytes vLLM's static per-tensor FP8 quantization (``QuantFP8.forward_native``, the native
        form of its CUDA cache write: x / scale, saturated) makes of them, "storage_dtype": the torch
        dtype vLLM allocates that cache in, "page_size_bytes": one block's page of one layer
        (``FullAttentionSpec``, what the decode's NIXL block_len is)}.
    .venv-vllm/bin/python tests/kv_transfer/vllm_reference.py fp8_ckpt < case.json
        stdin: {"quantization_config": a checkpoint's, "layers": [{"name", "in", "out"}]}; stdout:
        {layer name: {parameter: [shape, dtype]}}, the parameters vLLM's quantization method for that
        config (compressed-tensors or fp8) creates for the layer: the checkpoint tensors it loads.
    .venv-vllm/bin/python tests/kv_transfer/vllm_reference.py all < {"hash":..,"decode":hex,"encode":..}
        the three above in one process (vLLM's import costs ~10 s).

The hash runs vLLM's function on a stand-in config object exposing exactly the attributes it
reads (model_config, cache_config, scheduler_config, speculative_config); ``vllm_version`` is
the installed vLLM's.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def _config(f: dict):
    mc = SimpleNamespace(model=f["model"], dtype=f["dtype"],
                         get_total_num_kv_heads=lambda: f["num_kv_heads"],
                         get_head_size=lambda: f["head_size"],
                         get_total_num_hidden_layers=lambda: f["num_hidden_layers"])
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype=f["cache_dtype"]),
                           scheduler_config=SimpleNamespace(
                               disable_hybrid_kv_cache_manager=not f["is_hma_enabled"]),
                           speculative_config=None)


def run(cmd: str, data):
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as md

    if cmd == "hash":
        out = [md.compute_nixl_compatibility_hash(_config(f), f["attn_backend_name"], f["transfer_mode"])
               for f in data]
        return {"vllm_version": __import__("vllm").__version__,
                "nixl_connector_version": md.NIXL_CONNECTOR_VERSION, "hashes": out}
    if cmd == "decode":
        payload = msgspec.msgpack.Decoder(md.NixlHandshakePayload).decode(data)
        meta = msgspec.msgpack.Decoder(md.NixlAgentMetadata).decode(payload.agent_metadata_bytes)
        fields = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in vars(meta).items()}
        return {"compatibility_hash": payload.compatibility_hash, "metadata": fields}
    if cmd == "encode":
        f = dict(data)
        f["agent_metadata"] = bytes.fromhex(f["agent_metadata"])
        f["ssm_sizes"] = tuple(f["ssm_sizes"])
        f["packed_member_layouts"] = {k: tuple(v) for k, v in f["packed_member_layouts"].items()}
        return msgspec.msgpack.Encoder().encode(md.NixlAgentMetadata(**f)).hex()
    if cmd == "fp8_kv":
        return fp8_kv(data)
    if cmd == "fp8_ckpt":
        return fp8_ckpt(data)
    raise SystemExit(f"unknown command {cmd}")


def fp8_kv(case: dict) -> dict:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    x = torch.frombuffer(bytearray(bytes.fromhex(case["values"])), dtype=torch.float32)
    with set_current_vllm_config(VllmConfig()):
        quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
    codes, _ = quant.forward_native(x[None], torch.tensor([case["scale"]], dtype=torch.float32))
    model = SimpleNamespace(dtype=getattr(torch, case["model_dtype"]))
    storage = kv_cache_dtype_str_to_dtype(case["cache_dtype"], model)
    spec = FullAttentionSpec(block_size=case["block_size"], num_kv_heads=case["num_kv_heads"],
                             head_size=case["head_size"], dtype=storage)
    return {"codes": codes.view(torch.uint8).numpy().tobytes().hex(), "storage_dtype": str(storage),
            "page_size_bytes": spec.page_size_bytes}



def fp8_ckpt(case: dict) -> dict:
    """vLLM's linear method for each layer, in a one-process tensor-parallel group (its layers ask
    for their rank); the config stand-in has the two model_config attributes the schemes read."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.quantization import get_quantization_config

    qc = case["quantization_config"]
    config = get_quantization_config(qc["quant_method"]).from_config(qc)
    vc = VllmConfig()
    object.__setattr__(vc, "model_config", SimpleNamespace(dtype=torch.bfloat16, is_moe=False))

    class Linear(torch.nn.Module):  # compressed-tensors targets layers by class name
        pass

    out = {}
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        initialize_model_parallel(1, 1)
        for spec in case["layers"]:
            layer = Linear()
            if qc["quant_method"] == "compressed-tensors":
                scheme = config.get_scheme(layer, layer_name=spec["name"])
                scheme.create_weights(layer=layer, output_partition_sizes=[spec["out"]],
                                      input_size_per_partition=spec["in"], params_dtype=torch.bfloat16,
                                      weight_loader=lambda *a, **k: None, input_size=spec["in"],
                                      output_size=spec["out"])
            else:
                from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

                Fp8LinearMethod(config).create_weights(layer, spec["in"], [spec["out"]], spec["in"], spec["out"],
                                                       torch.bfloat16, weight_loader=lambda *a, **k: None)
            out[spec["name"]] = {n: [list(p.shape), str(p.dtype)] for n, p in layer.named_parameters()}
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    cmd = sys.argv[1]
    if cmd == "all":  # one process for all three: {"hash": [...], "decode": hex, "encode": {...}}
        data = json.load(sys.stdin)
        out = {"hash": run("hash", data["hash"]), "decode": run("decode", bytes.fromhex(data["decode"])),
               "encode": run("encode", data["encode"])}
    elif cmd == "decode":
        out = run(cmd, sys.stdin.buffer.read())
    else:
        out = run(cmd, json.load(sys.stdin))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()

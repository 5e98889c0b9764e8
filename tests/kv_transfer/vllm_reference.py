"""Run vLLM 0.32's own NIXL connector code (in .venv-vllm, never imported by our tests).

    .venv-vllm/bin/python tests/kv_transfer/vllm_reference.py hash < cases.json
        stdin: a JSON list of factor dicts (keys of ``compatibility_factors``); stdout: the hashes
        ``vllm...nixl.metadata.compute_nixl_compatibility_hash`` computes for a config with them.
    .venv-vllm/bin/python tests/kv_transfer/vllm_reference.py decode < payload.bin
        stdin: a side-channel reply frame; stdout: JSON of the NixlHandshakePayload and the
        NixlAgentMetadata vLLM's decoders read from it (bytes fields as hex).
    .venv-vllm/bin/python tests/kv_transfer/vllm_reference.py encode < metadata.json
        stdin: JSON NixlAgentMetadata fields (bytes as hex); stdout: hex of vLLM's own msgpack.
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
    raise SystemExit(f"unknown command {cmd}")


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

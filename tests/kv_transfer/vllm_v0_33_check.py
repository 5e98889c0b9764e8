"""Run vLLM 0.33's own NixlConnector code against what our producer sends (in .venv-vllm033, never
imported by our tests; ``test_vllm_v0_33.py`` runs it as a subprocess):

    VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python tests/kv_transfer/vllm_v0_33_check.py < request.json

stdin, JSON: ``model_dir`` (an empty folder: a tiny llama config.json is written there),
``geometry`` {layers, kv_heads, head_dim, block_size, num_blocks} (our pool's), ``factors`` (our
hash factors for that model), ``hash_cases`` (more factor dicts), ``params`` (our
``kv_transfer_params``), ``num_prompt_tokens``, ``payload`` (hex of our side channel's first reply
frame). stdout, last line, JSON of what vLLM's code computed.

It builds a real ``VllmConfig`` on vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``: the CUDA wheel
has no CPU twin for 0.33) with ``kv_connector: NixlConnector``, kv_consumer, and asks:
- ``compute_nixl_compatibility_hash`` of that config for the decode's backend name (``hash``) and
  of stand-in configs for ``hash_cases``;
- vLLM's msgspec ``NixlHandshakePayload`` / ``NixlAgentMetadata`` decoders on our reply, and its
  encoder on what they read (``metadata_reencoded``);
- ``NixlPullConnectorScheduler.get_num_new_matched_tokens`` for a request carrying our params,
  then ``update_state_after_alloc`` and ``build_connector_meta``: what its worker would be told
  to read (``recv``, with the registration generation it parsed);
- ``KVConnectorBase_V1.supports_sleep_mode`` as our connector class answers it;
- with ``nixl`` importable: ``NixlPullConnectorWorker`` registering CPU caches and doing its
  handshake with our side channel (hash check, metadata decode, validation, loading our agent).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's own switch to its CPU platform


def write_model(model_dir: str, g: dict) -> None:
    """A tiny llama's config.json (no weights: nothing here runs the model)."""
    os.makedirs(model_dir, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": g["kv_heads"] * g["head_dim"],
           "num_attention_heads": g["kv_heads"], "num_key_value_heads": g["kv_heads"],
           "head_dim": g["head_dim"], "num_hidden_layers": g["layers"], "intermediate_size": 64,
           "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "float32", "rms_norm_eps": 1e-5}
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)


def vllm_config(model_dir: str, g: dict, engine_id: str):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=512,
                                 enforce_eager=True),
        cache_config=CacheConfig(block_size=g["block_size"]),
        kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer",
                                            engine_id=engine_id))


def kv_cache_config(g: dict):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    names = [f"model.layers.{i}.self_attn.attn" for i in range(g["layers"])]
    spec = FullAttentionSpec(block_size=g["block_size"], num_kv_heads=g["kv_heads"], head_size=g["head_dim"],
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=g["num_blocks"], kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)]), names, spec


def stand_in_config(f: dict):
    """The attributes compute_nixl_compatibility_hash reads, for factors without a model."""
    mc = SimpleNamespace(model=f["model"], dtype=f["dtype"], get_total_num_kv_heads=lambda: f["num_kv_heads"],
                         get_head_size=lambda: f["head_size"],
                         get_total_num_hidden_layers=lambda: f["num_hidden_layers"])
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype=f["cache_dtype"]),
                           scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not f["is_hma_enabled"]),
                           speculative_config=None)


def scheduler_side(cfg, kvc, req: dict) -> dict:
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    sched = NixlPullConnectorScheduler(cfg, cfg.kv_transfer_config.engine_id, kvc)
    n = req["num_prompt_tokens"]
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": dict(req["params"])})
    request = Request("decode-req", list(range(1, n + 1)), sp, None)
    matched = sched.get_num_new_matched_tokens(request, 0)
    bs = cfg.cache_config.block_size
    local = KVCacheBlocks(([KVCacheBlock(block_id=100 + i) for i in range(-(-n // bs))],))
    sched.update_state_after_alloc(request, local, matched[0])
    meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None,
                                                      finished_req_ids=set()))
    remote = meta.reqs_to_recv["decode-req"].remote
    return {"matched": list(matched),
            "recv": {"remote_block_ids": [list(b) for b in remote.block_ids], "engine_id": remote.engine_id,
                     "request_id": remote.request_id, "port": remote.port,
                     "registration_generation": remote.registration_generation}}


def worker_side(cfg, kvc, names, spec, req: dict) -> dict:
    """vLLM's decode worker registers CPU caches and handshakes with our live side channel."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    g, params = req["geometry"], req["params"]
    with set_current_vllm_config(cfg):
        # what the engine core does before it builds workers: resolve the page layout its backends take
        layouts = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(cfg))]
        resolve_kv_cache_layout(cfg, [layouts], [spec])
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method="tcp://127.0.0.1:%d" % req.get("dist_port", 29533))
        ps.initialize_model_parallel(1, 1)
        worker = NixlPullConnectorWorker(cfg, cfg.kv_transfer_config.engine_id, kvc)
        # one layer's cache as a worker hands it over under LBHNC: [blocks, heads, tokens, K|V]
        shape = (g["num_blocks"], g["kv_heads"], g["block_size"], 2 * g["head_dim"])
        caches = {n: torch.zeros(shape, dtype=spec.dtype) for n in names}
        worker.register_kv_caches(caches)
        agents, _offset = worker._nixl_handshake(params["remote_host"], params["remote_port"], params["tp_size"],
                                                 params["remote_engine_id"])
        worker.shutdown()
    return {"handshake": "ok", "agents": sorted(str(k) for k in agents), "layout": cfg.cache_config.kv_cache_layout,
            "backend": worker.backend_name, "compat_hash": worker.compat_hash}


def main() -> None:
    req = json.load(sys.stdin)
    import msgspec
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as md

    from kv_transfer.vllm.connector import PrefillServerConnector

    g = req["geometry"]
    write_model(req["model_dir"], g)
    cfg = vllm_config(req["model_dir"], g, "decode-033")
    kvc, names, spec = kv_cache_config(g)
    out: dict = {"vllm_version": vllm.__version__, "nixl_connector_version": md.NIXL_CONNECTOR_VERSION,
                 "model": cfg.model_config.model, "dtype": str(cfg.model_config.dtype)}
    out["hash"] = md.compute_nixl_compatibility_hash(cfg, req["factors"]["attn_backend_name"], "pull")
    out["hash_cases"] = [md.compute_nixl_compatibility_hash(stand_in_config(f), f["attn_backend_name"],
                                                            f["transfer_mode"]) for f in req["hash_cases"]]
    payload = msgspec.msgpack.Decoder(md.NixlHandshakePayload).decode(bytes.fromhex(req["payload"]))
    meta = msgspec.msgpack.Decoder(md.NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    out["payload_hash"] = payload.compatibility_hash
    out["metadata_reencoded"] = msgspec.msgpack.Encoder().encode(meta).hex()
    out.update(scheduler_side(cfg, kvc, req))
    assert "supports_sleep_mode" in vars(KVConnectorBase_V1), "vLLM 0.33's base class has supports_sleep_mode"
    out["supports_sleep_mode"] = PrefillServerConnector.supports_sleep_mode(cfg.kv_transfer_config)
    try:
        import nixl._api  # noqa: F401 - NixlWrapper's backing package
    except ImportError as e:
        out["worker_skipped"] = f"nixl is not importable in this venv ({e})"
    else:
        try:
            out["worker"] = worker_side(cfg, kvc, names, spec, req)
        except Exception as e:  # noqa: BLE001 - reported to the test, which shows it
            out["worker"] = {"handshake": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

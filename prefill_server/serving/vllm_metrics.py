"""The ``vllm:`` series that PD routers score a prefill instance by, from our own numbers.

llm-d's scheduler (and vllm-router's load-aware policies) read a vLLM pod's
``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (a
fraction, despite its name) and ``vllm:cache_config_info``; we expose them beside our
``prefill_server:`` families, for the whole server (a pool's workers summed), labelled as vLLM
labels them (``model_name``, ``engine``).
"""
from __future__ import annotations

from prefill_server.engine.worker import WorkerLoad
from prefill_server.metrics import escape_label


def render(info, load: WorkerLoad) -> bytes:
    """``info``: the served model (``ModelInfo``); ``load``: the server's (``PrefillWorker.load``)."""
    labels = f'engine="0",model_name="{escape_label(info.served_name)}"'
    used = load.total_blocks - load.free_blocks
    usage = used / load.total_blocks if load.total_blocks else 0.0
    cache = {"block_size": str(load.block_size or info.block_size), "cache_dtype": info.kv_cache_dtype,
             "enable_prefix_caching": str(bool(info.prefix_cache)), "engine": "0",
             "num_gpu_blocks": str(load.total_blocks)}
    cache_labels = ",".join(f'{k}="{escape_label(v)}"' for k, v in sorted(cache.items()))
    lines = [
        "# HELP vllm:num_requests_waiting Requests waiting to be prefilled (vLLM's name, for PD routers).",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(load.waiting)}",
        "# HELP vllm:num_requests_running Requests being prefilled (vLLM's name, for PD routers).",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(load.running)}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage, 1 = full, leased blocks included (vLLM's name).",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {usage!r}",
        "# HELP vllm:cache_config_info Information of the KV cache (vLLM's name).",
        "# TYPE vllm:cache_config_info gauge",
        f"vllm:cache_config_info{{{cache_labels}}} 1.0",
    ]
    return ("\n".join(lines) + "\n").encode()


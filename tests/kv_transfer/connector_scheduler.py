"""Run our vLLM connector's scheduler side on vLLM's own request objects (in .venv-vllm, the only
venv where vLLM imports; never imported by our tests):

    .venv-vllm/bin/python tests/kv_transfer/connector_scheduler.py < cases.json

stdin: a JSON list of cases ``{"prompt_len", "num_computed", "params"}`` (``params``: the
request's ``kv_transfer_params``); stdout: a JSON list, per case, of what
``get_num_new_matched_tokens`` returned (``matched``, ``is_async``) and the receive the connector
then hands its worker (``build_connector_meta`` after ``update_state_after_alloc``; null if none).
The connector is built for the scheduler role on a stand-in config exposing exactly what its
constructor reads; requests are ``vllm.v1.request.Request`` and blocks ``KVCacheBlocks``.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

BLOCK_SIZE = 16
SECRET = "connector-scheduler-test-secret"


def _connector():
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kv_transfer.vllm.connector import PrefillServerConnector

    ktc = KVTransferConfig(kv_connector="PrefillServerConnector", kv_role="kv_consumer",
                           kv_connector_module_path="kv_transfer.vllm.connector",
                           kv_connector_extra_config={"secret": SECRET})
    mc = SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: {"model_type": "llama"}), dtype="torch.float32",
                         get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 1, get_head_size=lambda: 8)
    config = SimpleNamespace(kv_transfer_config=ktc, model_config=mc, parallel_config=None,
                             cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK_SIZE))
    return PrefillServerConnector(config, KVConnectorRole.SCHEDULER)


def run_case(conn, i: int, case: dict) -> dict:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    n = case["prompt_len"]
    req = Request(f"req-{i}", list(range(1, n + 1)), pooling_params=None,
                  sampling_params=SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": case["params"]}))
    matched, is_async = conn.get_num_new_matched_tokens(req, case["num_computed"])
    blocks = KVCacheBlocks(([KVCacheBlock(b) for b in range(-(-n // BLOCK_SIZE))],))
    conn.update_state_after_alloc(req, blocks, matched or 0)
    spec = conn.build_connector_meta(None).receive.get(req.request_id)
    return {"matched": matched, "is_async": is_async,
            "receive": None if spec is None else {"first_token": spec.first_token, "num_tokens": spec.num_tokens,
                                                  "mode": spec.mode, "num_blocks": len(spec.block_ids)}}


def main() -> None:
    conn = _connector()
    cases = json.load(sys.stdin)
    json.dump([run_case(conn, i, c) for i, c in enumerate(cases)], sys.stdout)


if __name__ == "__main__":
    main()

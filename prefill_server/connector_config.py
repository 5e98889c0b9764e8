"""What a vLLM decode needs to take our KV: its ``--kv-transfer-config`` per transfer mode and the
other flags (one place: the CLI, the demo and the e2e tests' decode launcher all use it)."""
from __future__ import annotations

CONNECTOR_CLASS = "PrefillServerConnector"
CONNECTOR_MODULE = "kv_transfer.vllm.connector"


def vllm_connector_config(secret_file: str | None = None, transfer_timeout_s: float | None = None,
                          transfer_mode: str | None = None) -> dict:
    """transfer_mode: None (the connector's default, push) or "pull" (the decode READs the KV the
    prefill leased, ``kv_transfer.pull``)."""
    extra: dict = {}
    if secret_file:
        extra["secret_file"] = secret_file
    if transfer_timeout_s is not None:
        extra["transfer_timeout_s"] = transfer_timeout_s
    if transfer_mode is not None:
        extra["transfer_mode"] = transfer_mode
    cfg = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
           "kv_role": "kv_consumer"}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


NIXL_CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}  # a stock vLLM decode's

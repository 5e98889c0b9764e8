"""vLLM 0.32's ``NixlConnector`` wire: what is specific to it. The facts were read from
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` of vllm(-cpu) 0.32.0; what every version
shares (structs, hash function, params, page layout) is ``kv_transfer.vllm.nixl_wire``.

- ``NIXL_CONNECTOR_VERSION`` 14 (hashed, with the decode's exact version string "0.32.x").
- ``kv_transfer_params`` without a registration generation: a 0.32 decode keeps the agent it
  loaded for an engine id, so a producer that registers its pool again must take a new engine id
  (``NixlCompatProducer`` does unless given a fixed one).
"""
from __future__ import annotations

from kv_transfer.vllm.nixl_wire import NixlWire

VLLM_VERSION = "0.32.0"
NIXL_CONNECTOR_VERSION = 14
WIRE = NixlWire(VLLM_VERSION, NIXL_CONNECTOR_VERSION)


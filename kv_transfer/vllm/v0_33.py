"""vLLM 0.33's ``NixlConnector`` wire: what differs from 0.32 (``kv_transfer.vllm.v0_32``), read
from ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` of vllm 0.33.0. Everything else
(``NixlAgentMetadata``'s 21 fields, ``NixlHandshakePayload``, get_meta_msg, the ``"{id}:{n}"``
notification, ``HB:`` heartbeats, the 30 s lease, the hash function and its 12 factors) is
unchanged and lives in ``kv_transfer.vllm.nixl_wire``.

- ``NIXL_CONNECTOR_VERSION`` 15 (hashed, with the decode's exact version string "0.33.x").
- ``kv_transfer_params["remote_registration_generation"]`` (int, 0 when absent): the decode
  drops the agent it loaded for ``remote_engine_id`` and handshakes again when the number is
  higher than the one it saw last (``pull_worker``). vLLM's own prefill bumps it whenever its
  encoded handshake metadata changes (1 after its first registration); ours bumps it on every
  registration of the pool (``NixlCompatProducer.registration_generation``).
- The decode needs NIXL >= 1.5.0 and builds strided descriptors from ``block_strides`` x
  ``region_num_blocks``: ours all lie inside the registered pool.
"""
from __future__ import annotations

from kv_transfer.vllm.nixl_wire import NixlWire

VLLM_VERSION = "0.33.0"
NIXL_CONNECTOR_VERSION = 15
WIRE = NixlWire(VLLM_VERSION, NIXL_CONNECTOR_VERSION, registration_generation=True)

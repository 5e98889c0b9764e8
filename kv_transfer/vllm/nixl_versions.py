"""The vLLM versions nixl-compat speaks, one ``NixlWire`` per minor series: the decode's version
picks one. A new version is a module beside ``v0_33`` and one entry in ``WIRES``."""
from __future__ import annotations

from kv_transfer.vllm import nixl_decode, v0_32, v0_33
from kv_transfer.vllm.discovery import DecodeFacts
from kv_transfer.vllm.nixl_decode import DecodeInfo
from kv_transfer.vllm.nixl_wire import NixlWire

WIRES: tuple[NixlWire, ...] = (v0_32.WIRE, v0_33.WIRE)
SUPPORTED = nixl_decode.supported_text(WIRES)  # "0.32.x, 0.33.x": for messages and docs


def wire_for(vllm_version: str, url: str = "the decode") -> NixlWire:
    """The wire of ``vllm_version``; ``InvalidRequest`` naming the supported versions if none."""
    return nixl_decode.wire_for(vllm_version, WIRES, url)


def decode_info(facts: DecodeFacts, *, attn_backend_name: str | None = None,
                is_hma_enabled: bool = True) -> DecodeInfo:
    """``nixl_decode.decode_info`` for any version we speak."""
    return nixl_decode.decode_info(facts, WIRES, attn_backend_name=attn_backend_name,
                                   is_hma_enabled=is_hma_enabled)


def discover_decode(url: str, *, attn_backend_name: str | None = None, is_hma_enabled: bool = True,
                    timeout_s: float = 5.0) -> DecodeInfo:
    """``nixl_decode.discover_decode`` for any version we speak."""
    return nixl_decode.discover_decode(url, WIRES, attn_backend_name=attn_backend_name,
                                       is_hma_enabled=is_hma_enabled, timeout_s=timeout_s)

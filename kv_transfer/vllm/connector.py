"""Our vLLM connector (decode side of connector mode): loaded by an unmodified vLLM through

    --kv-transfer-config '{"kv_connector":"PrefillServerConnector",
                           "kv_connector_module_path":"kv_transfer.vllm.connector",
                           "kv_role":"kv_consumer",
                           "kv_connector_extra_config":{"secret_file":"/path/to/secret"}}'

(``prefill-server vllm-config --transfer-mode connector`` prints it). The secret may instead come
from the decode's ``PREFILL_SERVER_SECRET`` environment variable. Other extra-config keys:
``transfer_timeout_s`` (default 120: no layer for that long fails the request; in pull mode it
must cover a whole prefill); ``transfer_mode`` ("push", the default: the prefill WRITEs each layer
into our blocks as it is computed; "pull": the prefill computes the whole prompt, leases its blocks
and we READ them, ``kv_transfer.pull``; a request's ``kv_transfer_params.prefill_server.
transfer_mode`` overrides it); ``kv_cache_layout`` (the page layout we ask vLLM for, default
"LBHNC", our pool's page: whole-page descriptors and no conversion; "auto" lets vLLM choose; any
layout of ``kv_transfer.layout.LAYOUTS`` works).

A request whose ``kv_transfer_params`` carry ``{"prefill_server": {request_id, host, port,
num_tokens}}`` (what our gateway sends) is loaded from the prefill server: the KV of its first
``num_tokens`` prompt tokens (all of them without it). A prompt one token longer (the prefill's
first token appended, when the gateway ran the prefill first) thus loads the prefill's tokens and
vLLM computes the last one itself, as it does the last of a fully loaded prompt:

    scheduler: get_num_new_matched_tokens -> (prompt tokens not cached locally, async)
               update_state_after_alloc   -> remember the request's block ids
               build_connector_meta       -> hand new receives / cancels to the worker
    worker:    start_load_kv              -> PushReceiver.register (signed Register, background)
               ... the prefill WRITEs each layer into those blocks, one notification per layer ...
               get_transfer_results       -> all layers in: (CPU decode: repack the pages into
                                             its ISA layout) and report it finished; vLLM then
                                             schedules the request
    pull:      the Register asks for pull; on the prefill's "ready" notification the receiver
               fetches the signed Offer and READs the leased blocks (the READ's notification frees
               them); then as above
    failure:   refusal, "fail" from the prefill, or no layer for transfer_timeout_s -> the
               request is reported in failed_recving + its blocks as load errors, and vLLM's
               ``kv_load_failure_policy`` applies ("fail": the client gets an error)
    abort:     request_finished while still receiving -> Cancel to the prefill; vLLM keeps the
               blocks until the prefill acknowledged (no WRITE can land in reused blocks)

What this module depends on from vLLM (all imported in the block below, nowhere else): the
classes ``KVConnectorBase_V1``, ``KVConnectorRole``, ``KVConnectorMetadata``,
``KVConnectorTransferResults``; ``Request.kv_transfer_params / num_prompt_tokens /
request_id / status`` and ``RequestStatus.FINISHED_ABORTED``; ``KVCacheBlocks.get_block_ids()``; ``vllm_config.model_config`` (hf_config,
dtype, get_num_layers / get_num_kv_heads / get_head_size), ``cache_config.block_size /
cache_dtype / get_resolved_kv_cache_layout()``, ``kv_transfer_config.kv_connector_extra_config``;
the classmethod hook ``get_required_kvcache_layout``; the per-layer cache views
``register_kv_caches`` gets (logical ``[B, H, N, 2D]``, strides of a ``KVCacheLayout``);
``current_platform.is_cpu()``
and ``current_platform.pack_kv_cache(cache, indices)`` (CPU decode only); the classmethod
``supports_sleep_mode(kv_transfer_config)`` that vLLM 0.33 added. Checked against vLLM 0.32.0
(tests/e2e/test_connector_pipeline.py).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # the vLLM API we use (see above)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.platforms import current_platform
from vllm.v1.request import RequestStatus

from kv_transfer import layout, wire
from kv_transfer.receiver import PushReceiver
from kv_transfer.wire import PARAMS_KEY

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class _RecvSpec:
    host: str
    port: int
    prefill_request_id: str
    block_ids: list[int]
    first_token: int
    num_tokens: int
    mode: str = "push"


@dataclass
class PrefillServerMeta(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    receive: dict[str, _RecvSpec] = field(default_factory=dict)  # vLLM request id -> spec
    cancel: dict[str, _RecvSpec] = field(default_factory=dict)


def _target(params: dict | None) -> dict | None:
    """Our part of a request's kv_transfer_params, if it is well-formed and not consumed yet."""
    p = (params or {}).get(PARAMS_KEY)
    if not isinstance(p, dict) or p.get("_consumed"):
        return None
    ok = (isinstance(p.get("request_id"), str) and isinstance(p.get("host"), str)
          and isinstance(p.get("port"), int) and p.get("version") == wire.PROTOCOL_VERSION
          and p.get("transfer_mode", "push") in wire.TRANSFER_MODES
          and ("num_tokens" not in p or _positive_int(p["num_tokens"])))
    if not ok:
        log.warning("ignoring malformed %s kv_transfer_params %r: the decode computes the prompt itself",
                    PARAMS_KEY, p)
        return None
    return p


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _num_loaded(p: dict, request: Request) -> int:
    """Prompt tokens whose KV the prefill server has: its ``num_tokens``, at most the prompt (the
    prompt may be longer by the first token the prefill already sampled)."""
    return min(p.get("num_tokens", request.num_prompt_tokens), request.num_prompt_tokens)


def decode_geometry(vllm_config: VllmConfig) -> wire.Geometry:
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if cc.cache_dtype not in ("auto", None):
        raise ValueError(f"PrefillServerConnector needs --kv-cache-dtype auto (got {cc.cache_dtype})")
    return wire.Geometry(
        model_fingerprint=wire.model_fingerprint(mc.hf_config.to_dict()),
        num_layers=mc.get_num_layers(vllm_config.parallel_config),
        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_dim=mc.get_head_size(), block_size=cc.block_size,
        dtype=str(mc.dtype).removeprefix("torch."))


def _extra_mode(extra: dict) -> str:
    mode = extra.get("transfer_mode", "push")
    if mode not in wire.TRANSFER_MODES:
        raise ValueError(f"kv_connector_extra_config.transfer_mode must be one of {wire.TRANSFER_MODES}, "
                         f"not {mode!r}")
    return mode


class PrefillServerConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._timeout_s = float(extra.get("transfer_timeout_s", 120.0))
        self._mode = _extra_mode(extra)
        if not self._kv_transfer_config.is_kv_consumer:
            raise ValueError("PrefillServerConnector runs on the decode: use kv_role kv_consumer")
        self._geometry = decode_geometry(vllm_config)
        # scheduler side
        self._pending = PrefillServerMeta()
        self._inflight: dict[str, _RecvSpec] = {}
        # worker side
        self._secret = wire.load_secret(extra.get("secret"), extra.get("secret_file"))
        self._receiver: PushReceiver | None = None
        self._caches: list[torch.Tensor] = []
        self._by_prefill_id: dict[str, tuple[str, _RecvSpec]] = {}
        self._load_errors: set[int] = set()
        self._reported: dict[str, None] = {}  # vLLM ids already reported finished (insertion-ordered)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The page layout to ask vLLM for (it may refuse it for a backend that cannot use it; any
        layout then works, through per-layout descriptors and conversion)."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        name = extra.get("kv_cache_layout", wire.PLAIN_PAGE)
        return None if name == "auto" else layout.canonical(name)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No (vLLM 0.33+ asks before it lets a decode run ``--enable-sleep-mode``; 0.32 never
        calls it). Sleep remaps the KV cache while our receiver keeps it registered with NIXL and
        the prefill keeps WRITE targets in it; we have no unregister/restore."""
        return False

    # ================================================================ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        p = _target(request.kv_transfer_params)
        if p is None:
            return 0, False
        n = _num_loaded(p, request) - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        p = _target(request.kv_transfer_params)
        if p is None:
            return
        p["_consumed"] = True  # one transfer per request
        if num_external_tokens <= 0:
            return
        n = _num_loaded(p, request)
        spec = _RecvSpec(p["host"], p["port"], p["request_id"], list(blocks.get_block_ids()[0]),
                         n - num_external_tokens, n, p.get("transfer_mode", self._mode))
        self._pending.receive[request.request_id] = spec
        self._inflight[request.request_id] = spec

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._pending = self._pending, PrefillServerMeta()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            self._inflight.pop(rid, None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        spec = self._inflight.pop(request.request_id, None)
        # Aborted while its KV was arriving: stop the prefill first. (A request failed for a KV
        # load error was already reported finished by the worker: nothing more to send, and a
        # second report of it would trip vLLM's scheduler.)
        # (Not registered yet: the Cancel still goes, so the prefill stops waiting for it and the
        # worker reports the request finished, which vLLM waits for before freeing its blocks.)
        if spec is not None and request.status == RequestStatus.FINISHED_ABORTED:
            self._pending.receive.pop(request.request_id, None)
            self._pending.cancel[request.request_id] = spec
        return False, None  # vLLM itself holds the blocks until we report the receive finished

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def layer_of(name: str) -> int:
            m = re.search(r"layers\.(\d+)\.", name)
            return int(m.group(1)) if m else -1

        names = sorted(kv_caches, key=layer_of)
        self._caches = [kv_caches[n] for n in names]
        try:  # what vLLM resolved, checked against the views' strides
            resolved = self._vllm_config.cache_config.get_resolved_kv_cache_layout().name
        except (AttributeError, ValueError):
            resolved = None
        self._receiver = PushReceiver(self._caches, self._geometry, self._secret, timeout_s=self._timeout_s,
                                      layout_name=resolved)
        log.info("PrefillServerConnector: %d layer caches registered (%s, page layout %s, transfer %s)",
                 len(names), self._receiver.engine_id, self._receiver.addressing.layout, self._mode)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefillServerMeta) and self._receiver is not None
        for rid, spec in meta.receive.items():
            self._by_prefill_id[spec.prefill_request_id] = (rid, spec)
            self._receiver.register(spec.host, spec.port, spec.prefill_request_id, spec.block_ids,
                                    spec.first_token, spec.num_tokens, spec.mode)
        for rid, spec in meta.cancel.items():
            if rid in self._reported:
                continue  # its KV already arrived (or failed) and vLLM was told: nothing to stop
            self._by_prefill_id[spec.prefill_request_id] = (rid, spec)  # reported once acknowledged
            self._receiver.cancel(spec.host, spec.port, spec.prefill_request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once all its layers are in

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # consumer only

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._receiver is None:
            return KVConnectorTransferResults()
        polled = self._receiver.poll()
        out = KVConnectorTransferResults()
        for pid in polled.done:
            rid, spec = self._by_prefill_id.pop(pid, (None, None))
            if rid is None:
                continue
            self._repack(spec)
            out.finished_recving.add(rid)
        for pid, reason in polled.failed.items():
            rid, spec = self._by_prefill_id.pop(pid, (None, None))
            if rid is None:
                continue
            log.error("request %s: KV from the prefill server failed: %s", rid, reason)
            out.finished_recving.add(rid)
            out.failed_recving.add(rid)
            self._load_errors.update(self._written_blocks(spec))
        for pid in polled.cancelled:
            rid, _ = self._by_prefill_id.pop(pid, (None, None))
            if rid is not None:
                out.finished_recving.add(rid)
        out.finished_recving -= self._reported.keys()  # each request is reported exactly once
        out.failed_recving &= out.finished_recving
        for rid in out.finished_recving:
            self._reported[rid] = None
        while len(self._reported) > 100_000:
            del self._reported[next(iter(self._reported))]
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    # ---- helpers ----
    def _written_blocks(self, spec: _RecvSpec) -> list[int]:
        bs = self._geometry.block_size
        return spec.block_ids[spec.first_token // bs: -(-spec.num_tokens // bs)]

    def _repack(self, spec: _RecvSpec) -> None:
        """A CPU decode keeps pages in an ISA-specific layout: convert the plain pages we received."""
        if not current_platform.is_cpu():
            return
        idx = torch.tensor(self._written_blocks(spec), dtype=torch.long)
        for cache in self._caches:
            current_platform.pack_kv_cache(kv_cache=cache, indices=idx)

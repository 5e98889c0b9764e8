"""What every ``prefill-server bench e2e`` mode shares: the model (Llama-3.1-8B's shape or a tiny one,
random weights), an engine whose producer frees each request's blocks at once, driving the engine
on the calling thread, timing, and the common command-line options. Imported by ``e2e.py``,
``stream.py`` and the modules they are split into; imports none of them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kv_transfer.base import LeaseProducer, Route
from prefill_server.engine.engine import Engine
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.runner import ModelRunner
from prefill_server.engine.types import PrefillRequest
from prefill_server.models.config import Llama3RopeScaling, ModelConfig
from prefill_server.models.llama import LlamaForCausalLM


# ---- model ----
def model_config(preset: str) -> ModelConfig:
    """Llama-3.1-8B's shape (config.json of meta-llama/Llama-3.1-8B), or a tiny one for smoke runs."""
    common = dict(architecture="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
                  tie_word_embeddings=False, attention_bias=False, qk_norm=False, sliding_window=None,
                  dtype=torch.bfloat16, bos_token_id=128000, eos_token_ids=(128001,))
    if preset == "llama-3.1-8b":
        return ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                           num_heads=32, num_kv_heads=8, head_dim=128, **common)
    if preset == "tiny":
        return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, **common)
    raise ValueError(f"unknown preset {preset!r}; use llama-3.1-8b or tiny")


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 quantization: str = "none") -> LlamaForCausalLM:
    """The model built on the meta device, materialized once on ``device`` in ``dtype``, weights
    ~ N(0, 0.02) and norm weights 1 (timing does not depend on the values; no checkpoint needed);
    quantization "fp8": then its projections quantized as ``serve --quantization fp8`` does."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    if quantization == "fp8":
        from prefill_server.layers.fp8 import quantize_model
        quantize_model(model)
    return model.eval()


# ---- engine ----
class DropProducer(LeaseProducer):
    """Frees a finished request's KV blocks at once: the bench measures prefill, not transfer."""

    routes = frozenset({Route.LEASE})

    def __init__(self, pool: KVPool):
        self.pool = pool

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def publish(self, request_id: str, block_ids: list[int], num_tokens: int, *, decode_url: str | None = None) -> dict:
        self.pool.free(block_ids)
        return {}

    def abort(self, request_id: str, reason: str = "", on_idle=None) -> bool:
        if on_idle is not None:
            on_idle()
        return False


def make_engine(model, cfg: ModelConfig, pool: KVPool, device, token_budget: int, max_num_seqs: int,
                fp8_attention: str = "off") -> Engine:
    runner = ModelRunner(model, pool, cfg.head_dim, device, fp8_attention=fp8_attention)
    return Engine(runner, pool, DropProducer(pool), max_model_len=cfg.max_position_embeddings * 8,
                  vocab_size=cfg.vocab_size, token_budget=token_budget, max_num_seqs=max_num_seqs,
                  max_queue_wait_s=3600.0)


def drive(engine: Engine, reqs: list[PrefillRequest]) -> list:
    """Submit all, run the engine's steps on this thread until done; returns the results."""
    futs = [engine.submit(r) for r in reqs]
    while engine.scheduler.has_work():
        chunks, timed_out = engine.scheduler.schedule()
        assert not timed_out and chunks, "the bench pool is too small for its requests"
        engine.step(chunks)
    return [f.result(timeout=0) for f in futs]


# ---- timing ----
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, reps: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``reps`` calls (device synchronized around each), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def _randn(shape, device, dtype, g):
    return torch.randn(shape, device=device, dtype=torch.float32, generator=g).to(dtype)


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:
        return None


# ---- command line ----
def model_args(ap: argparse.ArgumentParser) -> None:
    """--preset, --device, --dtype (shared by ``bench e2e`` and ``bench e2e stream``)."""
    ap.add_argument("--preset", default="llama-3.1-8b", choices=["llama-3.1-8b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])


def ints(s: str) -> list[int]:
    """"8192,32768" -> [8192, 32768]; "" -> []."""
    return [int(x) for x in s.split(",") if x.strip()]


def bench_args(parse, argv: list[str], name: str):
    """``parse(argv)`` with ``argv`` kept on it (for the JSON); None if it asks for a GPU that is absent."""
    args = parse(argv)
    args.argv = argv
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{name}: no CUDA GPU here (use --preset tiny --device cpu for a smoke run)", file=sys.stderr)
        return None
    return args

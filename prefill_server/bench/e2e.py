"""``prefill-server bench e2e``: dense prefill end to end on Llama-3.1-8B-shaped random weights.

Requests go through the real engine path (``Engine.submit`` -> scheduler -> ``ModelRunner`` ->
``PagedAttention`` writing K/V into the pool's pages -> last-token logits -> first token), driven
step by step on the calling thread, with a producer that frees each request's blocks at once (this
measures prefill, not transfer). Per length it reports TTFT (submit to first token), peak GPU memory
and, measured in the same run, the floor:

    floor = linear layers at the best rate cuBLAS reaches on the model's own projections
            (each timed alone on 4K/8K/16K/32K-row inputs, x num_layers, + the last token's lm_head)
          + num_layers x cuDNN SDPA causal attention at that length (same q/k/v layout as the engine)

and ratio = TTFT / floor (the issue's target: <= 1.15 at 8K, 32K, 128K). Each floor term is timed in
short bursts; ``--sustained-floor`` also times the same work back to back as one forward would run
it (a GPU at its power cap runs slower clocks then). Also: a correctness check (engine logits and
pool K/V against the same model with a plain reference attention and the eager ops, and on CUDA
both against the model in float32), a torch.profiler breakdown of one prefill, cuDNN attention on
real vs random q/k/v, and the throughput of many concurrent requests under a token budget (against
the linear-layer floor for all their tokens; target >= 80%).

    prefill-server bench e2e --lengths 8192,32768,131072 --out e2e.json
    prefill-server bench e2e --preset tiny --device cpu --lengths 64,128   # a smoke run anywhere
    prefill-server bench e2e stream ...   # sparse mode + KV streamed to a receiver: bench/stream.py
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import statistics
import sys
import time
from concurrent.futures import Future

import torch
import torch.nn.functional as F

from prefill_server.engine.engine import Engine
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.runner import ModelRunner
from prefill_server.engine.scheduler import Chunk, Sequence
from prefill_server.engine.types import PrefillRequest
from prefill_server.models.config import Llama3RopeScaling, ModelConfig
from prefill_server.models.llama import LlamaForCausalLM
from prefill_server.models.reference_attention import CausalAttention

try:  # absent in older trees (the bench also runs against them for a before/after)
    from prefill_server.layers import fused
except ImportError:  # pragma: no cover
    fused = None

TARGET_RATIO = 1.15
TARGET_THROUGHPUT = 0.80


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


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """The model built on the meta device, materialized once on ``device`` in ``dtype``, weights
    ~ N(0, 0.02) and norm weights 1 (timing does not depend on the values; no checkpoint needed)."""
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
    return model.eval()


class DropProducer:
    """Frees a finished request's KV blocks at once: the bench measures prefill, not transfer."""

    def __init__(self, pool: KVPool):
        self.pool = pool

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def publish(self, request_id: str, block_ids: list[int], num_tokens: int) -> dict:
        self.pool.free(block_ids)
        return {}

    def abort(self, request_id: str) -> bool:
        return False


def make_engine(model, cfg: ModelConfig, pool: KVPool, device, token_budget: int, max_num_seqs: int) -> Engine:
    runner = ModelRunner(model, pool, cfg.head_dim, device)
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


# ---- floor ----
def layer_gemms(model: LlamaForCausalLM) -> list[tuple[str, torch.Tensor]]:
    """(name, weight [out, in]) of one decoder layer's projections, in forward order."""
    layer = model.model.layers[0]
    return [("qkv_proj", layer.self_attn.qkv_proj.weight), ("o_proj", layer.self_attn.o_proj.weight),
            ("gate_up_proj", layer.mlp.gate_up_proj.weight), ("down_proj", layer.mlp.down_proj.weight)]


class Floor:
    """Floor terms measured on this device, cached per row count / length."""

    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, device, dtype, reps: int, seed: int = 1):
        self.model, self.cfg, self.device, self.dtype, self.reps = model, cfg, device, dtype, reps
        self.g = torch.Generator(device=device).manual_seed(seed)
        self._gemm: dict[int, dict] = {}

    def gemm_rows(self, rows: int) -> dict:
        """One layer's projections on ``rows`` token rows: ms and FLOPs per GEMM."""
        if rows not in self._gemm:
            out, total_ms, total_flops = [], 0.0, 0
            for name, w in layer_gemms(self.model):
                x = _randn((rows, w.shape[1]), self.device, self.dtype, self.g)
                ms, _ = time_ms(lambda: F.linear(x, w), self.device, self.reps)
                flops = 2 * rows * w.shape[0] * w.shape[1]
                out.append({"gemm": name, "m": rows, "n": w.shape[0], "k": w.shape[1], "ms": ms,
                            "tflops": flops / ms / 1e9})
                total_ms, total_flops = total_ms + ms, total_flops + flops
                del x
            self._gemm[rows] = {"ms": total_ms, "flops": total_flops, "gemms": out}
        return self._gemm[rows]

    ROWS = (4096, 8192, 16384, 32768)

    def linear(self, tokens: int) -> dict:
        """All linear layers for one prompt of ``tokens``, plus lm_head on the last token, at the
        best per-token rate cuBLAS reaches on the model's projections among row counts ``ROWS``
        (capped at ``tokens``): the engine's choice of chunk rows cannot lower this floor."""
        rows = sorted({min(tokens, r) for r in self.ROWS})
        per_row = {r: self.gemm_rows(r) for r in rows}
        best = min(rows, key=lambda r: per_row[r]["ms"] / r)
        layer_ms = per_row[best]["ms"] * tokens / best
        flops = per_row[best]["flops"] * tokens // best * self.cfg.num_layers
        head = self.model.lm_head.weight
        x1 = _randn((1, head.shape[1]), self.device, self.dtype, self.g)
        head_ms, _ = time_ms(lambda: F.linear(x1, head), self.device, self.reps)
        ms = layer_ms * self.cfg.num_layers + head_ms
        return {"ms": ms, "tflops": flops / ms / 1e9, "flops": flops, "lm_head_ms": head_ms, "best_rows": best,
                "layer_ms_by_rows": {str(r): per_row[r]["ms"] for r in rows},
                "tflops_by_rows": {str(r): per_row[r]["flops"] / per_row[r]["ms"] / 1e9 for r in rows},
                "gemms_per_chunk": per_row[best]["gemms"]}

    def attention(self, tokens: int, reps: int) -> dict:
        """One layer's causal attention at ``tokens`` through cuDNN SDPA (any SDPA backend on CPU),
        on [1, H, T, D] views of [T, H, D] tensors: the layout the engine passes."""
        c = self.cfg
        q = _randn((tokens, c.num_heads, c.head_dim), self.device, self.dtype, self.g)
        k = _randn((tokens, c.num_kv_heads, c.head_dim), self.device, self.dtype, self.g)
        v = _randn((tokens, c.num_kv_heads, c.head_dim), self.device, self.dtype, self.g)
        qh, kh, vh = (z.transpose(0, 1)[None] for z in (q, k, v))
        gqa = c.num_heads != c.num_kv_heads

        def f():
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=c.head_dim ** -0.5,
                                                  enable_gqa=gqa)
        if self.device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms, times = time_ms(f, self.device, reps)
            backend = "cudnn"
        else:
            ms, times = time_ms(f, self.device, reps)
            backend = "sdpa-default"
        flops = 4 * c.num_heads * c.head_dim * tokens * (tokens + 1) // 2  # causal: QK^T and PV
        return {"layer_ms": ms, "ms": ms * c.num_layers, "tflops": flops / ms / 1e9, "backend": backend,
                "reps_ms": times}


    def sustained(self, tokens: int, chunk: int, reps: int = 2, attn_len: int = 0,
                  attention: bool = True) -> dict:
        """The floor's work run back to back as a forward runs it (per layer: the projections on
        ``chunk``-row pieces, cuDNN attention at ``tokens``), nothing else: what the mandatory GEMMs
        and attention cost at the clocks the GPU holds under sustained load (its power cap), where
        the per-op floor above times each op in a short burst. ``attn_len``: a batched step's
        ``tokens`` are ``tokens // attn_len`` prompts of ``attn_len`` (one attention call each);
        ``attention=False``: the GEMMs alone."""
        c, dev, dt, g = self.cfg, self.device, self.dtype, self.g
        (_, wqkv), (_, wo), (_, wgu), (_, wd) = layer_gemms(self.model)
        rows = min(chunk, tokens)
        xs = [_randn((rows, w.shape[1]), dev, dt, g) for w in (wqkv, wo, wgu, wd)]
        alen = attn_len or tokens
        q = _randn((alen, c.num_heads, c.head_dim), dev, dt, g)
        k = _randn((alen, c.num_kv_heads, c.head_dim), dev, dt, g)
        v = _randn((alen, c.num_kv_heads, c.head_dim), dev, dt, g)
        qh, kh, vh = (z.transpose(0, 1)[None] for z in (q, k, v))
        n_chunks = (tokens + rows - 1) // rows
        n_attn = max(1, tokens // alen) if attention else 0

        def forward():
            for _ in range(c.num_layers):
                for _ in range(n_chunks):
                    F.linear(xs[0], wqkv)
                for _ in range(n_attn):
                    F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=c.head_dim ** -0.5,
                                                   enable_gqa=c.num_heads != c.num_kv_heads)
                for _ in range(n_chunks):
                    F.linear(xs[1], wo)
                    F.linear(xs[2], wgu)
                    F.linear(xs[3], wd)
        if dev.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms, times = time_ms(forward, dev, reps)
        else:
            ms, times = time_ms(forward, dev, reps)
        return {"tokens": tokens, "rows": rows, "attn_len": alen, "attn_calls_per_layer": n_attn, "ms": ms,
                "reps_ms": times}


def matmul_peak(device, dtype, n: int, reps: int) -> dict:
    g = torch.Generator(device=device).manual_seed(2)
    a, b = _randn((n, n), device, dtype, g), _randn((n, n), device, dtype, g)
    ms, _ = time_ms(lambda: a @ b, device, reps)
    return {"n": n, "ms": ms, "tflops": 2 * n ** 3 / ms / 1e9}


# ---- correctness ----
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_engine(model, cfg: ModelConfig, pool: KVPool, device, tokens: int, seed: int = 3,
                 fp32: bool = False) -> dict:
    """Engine logits and pool K/V vs the same model with the plain reference attention
    (repeat_interleave + SDPA) and, where the fused kernels exist, the eager ops. With ``fp32`` also
    both against the model in float32 (converted in place and back: bf16 -> fp32 -> bf16 is exact),
    so that the engine's error is judged against the eager path's own bf16 error."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    seq = Sequence(PrefillRequest("check", tuple(ids.tolist())), Future())
    seq.block_ids = pool.allocate(pool.blocks_needed(tokens))
    try:
        runner = ModelRunner(model, pool, cfg.head_dim, device)
        got = runner.run([Chunk(seq, 0, tokens)])[0]
        ref_attn = CausalAttention.single(tokens, record=True)
        off = fused.enabled(False) if fused is not None else contextlib.nullcontext()
        with off, torch.no_grad():
            ref = model(ids.to(device), torch.arange(tokens, device=device), ref_attn,
                        torch.tensor([tokens - 1], device=device))[0]
        out = {"tokens": tokens, "logits_rel_err": _rel(got, ref),
               "logits_cos": float(F.cosine_similarity(got.double(), ref.double(), dim=0)),
               "argmax_equal": int(got.argmax()) == int(ref.argmax()), "finite": bool(torch.isfinite(got).all())}
        for layer in sorted({0, cfg.num_layers - 1}):
            k, v = pool.read(layer, seq.block_ids, tokens)
            out[f"k_rel_err_layer{layer}"] = _rel(k, ref_attn.keys[layer])
            out[f"v_rel_err_layer{layer}"] = _rel(v, ref_attn.values[layer])
        last = cfg.num_layers - 1
        k_eng, _ = pool.read(last, seq.block_ids, tokens)
        if fp32:
            dtype = next(model.parameters()).dtype
            k_ref, ref_attn = ref_attn.keys[last], None
            model.float()
            try:
                a32 = CausalAttention.single(tokens, record=True)
                with fused.enabled(False) if fused is not None else contextlib.nullcontext(), torch.no_grad():
                    r32 = model(ids.to(device), torch.arange(tokens, device=device), a32,
                                torch.tensor([tokens - 1], device=device))[0]
                k32 = a32.keys[last]
                a32 = None
            finally:
                model.to(dtype)
            out.update(engine_vs_fp32_logits=_rel(got, r32), eager_vs_fp32_logits=_rel(ref, r32),
                       engine_vs_fp32_k_last=_rel(k_eng, k32), eager_vs_fp32_k_last=_rel(k_ref, k32),
                       engine_argmax_eq_fp32=int(got.argmax()) == int(r32.argmax()),
                       eager_argmax_eq_fp32=int(ref.argmax()) == int(r32.argmax()))
        del ref_attn
    finally:
        pool.free(seq.block_ids)
    if fp32:  # as accurate as the eager bf16 path, within a margin
        out["pass"] = bool(out["finite"] and out["engine_vs_fp32_logits"] <= 1.5 * out["eager_vs_fp32_logits"] + 1e-3
                           and out["engine_vs_fp32_k_last"] <= 1.5 * out["eager_vs_fp32_k_last"] + 1e-3)
    else:
        out["pass"] = bool(out["finite"] and out["logits_rel_err"] < 5e-2 and out["logits_cos"] > 0.998
                           and all(val < 2e-2 for key, val in out.items() if key.startswith(("k_rel", "v_rel"))))
    return out


def check_fused(cfg: ModelConfig, device, dtype, rows: int = 2048) -> dict:
    """Each fused kernel against its eager ops on random data (CUDA only)."""
    if fused is None or not fused.available(torch.empty(0, device=device)):
        return {"skipped": "fused kernels unavailable here"}
    from prefill_server.layers.rotary import RotaryEmbedding, apply_rotary
    g = torch.Generator(device=device).manual_seed(4)
    c = cfg
    res = {}
    x = _randn((rows, c.hidden_size), device, dtype, g) * 3
    w = (1 + 0.1 * _randn((c.hidden_size,), device, torch.float32, g)).to(dtype)
    xf = x.float()
    eager = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(dtype)
    got = fused.rms_norm(x, w, c.rms_norm_eps)
    res["rms_norm_max_abs"] = float((got.float() - eager.float()).abs().max())
    res["rms_norm_rel"] = _rel(got, eager)
    qkv = _randn((rows, c.q_size + 2 * c.kv_size), device, dtype, g)
    cos, sin = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling).cos_sin(
        torch.randint(0, 100000, (rows,), device=device, generator=g), dtype)
    q, k, v = fused.rope_qkv(qkv, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim)
    eq, ek, ev = torch.split(qkv, [c.q_size, c.kv_size, c.kv_size], dim=-1)
    eq = apply_rotary(eq.reshape(rows, c.num_heads, c.head_dim), cos, sin)
    ek = apply_rotary(ek.reshape(rows, c.num_kv_heads, c.head_dim), cos, sin)
    res["rope_mismatch_frac"] = float(((q != eq).sum() + (k != ek).sum()) / (q.numel() + k.numel()))
    res["rope_max_abs"] = float(max((q.float() - eq.float()).abs().max(), (k.float() - ek.float()).abs().max()))
    res["rope_rel"] = max(_rel(q, eq), _rel(k, ek))
    res["v_copy_exact"] = bool(torch.equal(v, ev.reshape(rows, c.num_kv_heads, c.head_dim)))
    gu = _randn((rows, 2 * c.intermediate_size), device, dtype, g) * 3
    eg, eu = gu.chunk(2, dim=-1)
    es = F.silu(eg) * eu
    gs = fused.silu_mul(gu)
    res["silu_mul_max_abs"] = float((gs.float() - es.float()).abs().max())
    res["silu_mul_rel"] = _rel(gs, es)
    page = torch.full((rows // 16 + 2, c.num_kv_heads, 16, 2 * c.head_dim), float("nan"), device=device, dtype=dtype)
    ref_page = page.clone()
    perm = torch.randperm(page.shape[0], device=device, generator=g)
    pos = torch.arange(rows, device=device)
    blocks, offs = perm[pos // 16], pos % 16
    fused.kv_write(page, blocks, offs, k, v)
    ref_page[blocks, :, offs, : c.head_dim] = k
    ref_page[blocks, :, offs, c.head_dim:] = v
    res["kv_write_exact"] = bool(torch.equal(page.nan_to_num(7.0), ref_page.nan_to_num(7.0)))
    res["pass"] = bool(res["rope_rel"] < 1e-2 and res["v_copy_exact"] and res["kv_write_exact"]
                       and res["rms_norm_rel"] < 1e-2 and res["silu_mul_rel"] < 1e-2)
    return res


def attention_diagnostics(model, cfg: ModelConfig, device, dtype, tokens: int, reps: int = 5) -> dict:
    """cuDNN attention at ``tokens`` on random q/k/v and on the last layer's real q/k/v (captured from
    a forward), each alone and right after a large GEMM as inside a forward: separates effects of the
    data from effects of the GPU's state (clocks under sustained GEMM load)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from prefill_server.layers.attention import dense_attention
    last, scale, cap = cfg.num_layers - 1, cfg.head_dim ** -0.5, {}

    def attn(layer, q, k, v):
        if layer == last:
            cap["qkv"] = (q.clone(), k.clone(), v.clone())
        return dense_attention(q, k, v, scale)
    g = torch.Generator(device=device).manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=device, generator=g)
    with torch.no_grad():
        model(ids, torch.arange(tokens, device=device), attn, torch.tensor([tokens - 1], device=device))
    rnd = tuple(_randn(z.shape, device, dtype, g) for z in cap["qkv"])
    w = model.model.layers[0].mlp.gate_up_proj.weight
    xg = _randn((8192, w.shape[1]), device, dtype, g)
    res: dict = {"tokens": tokens}
    for name, (q, k, v) in (("random", rnd), ("captured", cap["qkv"])):
        qh, kh, vh = (z.transpose(0, 1)[None] for z in (q, k, v))
        f = lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,  # noqa: E731
                                                   enable_gqa=True)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            res[f"{name}_alone_ms"] = time_ms(f, device, reps)[0]
            times = []
            for _ in range(reps + 1):
                F.linear(xg, w)
                F.linear(xg, w)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                f()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            res[f"{name}_after_gemm_ms"] = statistics.median(times[1:])
        res[f"{name}_q_absmax"], res[f"{name}_k_absmax"] = float(q.abs().max()), float(k.abs().max())
        res[f"{name}_q_std"], res[f"{name}_k_std"] = float(q.float().std()), float(k.float().std())
    return res


# ---- profile ----
def _category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("sdpa", "fmha", "flash", "attention", "cudnn")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")):
        return "gemm"
    if any(s in n for s in ("rms_norm_kernel", "rope_qkv_kernel", "silu_mul_kernel", "kv_write_kernel")):
        return "fused_triton"
    if "index" in n or "scatter" in n:
        return "index"
    if "copy" in n or "cat" in n:
        return "copy"
    return "other_elementwise"


def profile_prefill(engine: Engine, cfg: ModelConfig, tokens: int, device, requests: int = 1) -> dict:
    """``requests`` prefills of ``tokens`` (one engine run) under torch.profiler: GPU time per
    kernel category and the top kernels."""
    from torch.profiler import ProfilerActivity, profile
    from torch.autograd import DeviceType
    reqs = [PrefillRequest(f"profile-{i}", tuple(torch.randint(0, cfg.vocab_size, (tokens,)).tolist()))
            for i in range(requests)]
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        drive(engine, reqs)
        _sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    kernels = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        kernels.append({"name": e.key[:160], "ms": us / 1e3, "count": e.count, "category": _category(e.key)})
    kernels.sort(key=lambda r: -r["ms"])
    try:
        text = prof.key_averages().table(sort_by="self_cuda_time_total" if device.type == "cuda"
                                         else "self_cpu_time_total", row_limit=30)
    except Exception as e:  # the table is a convenience
        text = f"(no table: {e})"
    cats: dict[str, float] = {}
    for r in kernels:
        cats[r["category"]] = cats.get(r["category"], 0.0) + r["ms"]
    busy = sum(cats.values())
    return {"tokens": tokens, "requests": requests, "wall_ms_with_profiler": wall_ms, "gpu_busy_ms": busy,
            "by_category_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])), "top_kernels": kernels[:20],
            "table": text}


# ---- the run ----
def ttft_runs(engine: Engine, cfg: ModelConfig, tokens: int, reps: int, warmup: int, device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    times, engine_s = [], []
    base = peak = 0
    for i in range(warmup + reps):
        ids = tuple(torch.randint(0, cfg.vocab_size, (tokens,), generator=g).tolist())
        req = PrefillRequest(f"ttft-{tokens}-{i}", ids)
        _sync(device)
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        (res,) = drive(engine, [req])  # the first token is on the host: the forward is done
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            engine_s.append(res.timings.total_s)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    return {"tokens": tokens, "ttft_s": statistics.median(times), "reps_s": times, "warmup": warmup,
            "engine_total_s": engine_s, "peak_mem_gib": peak / 2**30,
            "activation_peak_gib": (peak - base) / 2**30 if peak else 0.0}


def throughput_run(engine: Engine, cfg: ModelConfig, n: int, tokens: int, device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    reqs = [PrefillRequest(f"tp-{i}", tuple(torch.randint(0, cfg.vocab_size, (tokens,), generator=g).tolist()))
            for i in range(n)]
    _sync(device)
    t0 = time.perf_counter()
    futs = [engine.submit(r) for r in reqs]
    steps = []  # (tokens, host time scheduling, step wall time incl. the first-token sync)
    while engine.scheduler.has_work():
        a = time.perf_counter()
        chunks, timed_out = engine.scheduler.schedule()
        assert not timed_out and chunks, "the bench pool is too small for its requests"
        b = time.perf_counter()
        engine.step(chunks)
        steps.append((sum(c.end - c.start for c in chunks), b - a, time.perf_counter() - b))
    res = [f.result(timeout=0) for f in futs]
    wall = time.perf_counter() - t0
    ttfts = sorted(r.timings.total_s for r in res)
    return {"requests": n, "tokens_each": tokens, "token_budget": engine.scheduler.token_budget, "wall_s": wall,
            "tokens_per_s": n * tokens / wall, "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_max_s": ttfts[-1],
            "steps": [{"tokens": t, "schedule_s": s, "step_s": d} for t, s, d in steps]}


def model_args(ap: argparse.ArgumentParser) -> None:
    """--preset, --device, --dtype (shared with ``bench e2e stream``)."""
    ap.add_argument("--preset", default="llama-3.1-8b", choices=["llama-3.1-8b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="prefill-server bench e2e", description=__doc__.split("\n\n")[0])
    model_args(ap)
    ap.add_argument("--lengths", default="8192,32768,131072", help="prompt lengths for TTFT (comma-separated)")
    ap.add_argument("--reps", type=int, default=3, help="timed prefills per length")
    ap.add_argument("--long-reps", type=int, default=2, help="timed prefills per length above --warmup-max")
    ap.add_argument("--warmup-max", type=int, default=32768,
                    help="lengths up to this get one untimed warm-up prefill (the floor's runs warm longer ones)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=0, help="model.chunk_tokens (0 = the model's default)")
    ap.add_argument("--check-len", type=int, default=8192, help="engine-vs-reference check length (0 = skip)")
    ap.add_argument("--profile-len", type=int, default=0, help="profile one prefill of this length (0 = skip)")
    ap.add_argument("--throughput", default="64x8192", help="NxL concurrent requests ('' = skip)")
    ap.add_argument("--token-budget", type=int, default=65536, help="token budget for the throughput run")
    ap.add_argument("--throughput-floor", action="store_true",
                    help="also time one throughput step's floor work back to back (GEMMs at the chunk rows on "
                    "--token-budget rows + one cuDNN call per prompt), with and without attention")
    ap.add_argument("--throughput-densities", default="",
                    help="also run the throughput with sparse attention (default SparseConfig: layer 0 dense, the "
                    "estimator runs) whose kernel computes a fixed mask of each density, e.g. 0.3,0.5")
    ap.add_argument("--profile-throughput", type=int, default=0,
                    help="profile this many throughput-sized requests under the throughput engine (0 = skip)")
    ap.add_argument("--check-fp32", type=int, default=1,
                    help="on CUDA, also judge engine and eager bf16 paths against the model in float32 (1/0)")
    ap.add_argument("--compare-unfused", default="", help="lengths also timed with the fused kernels off")
    ap.add_argument("--compare-chunk", type=int, default=0, help="also time --compare-chunk-lengths with this "
                    "model.chunk_tokens")
    ap.add_argument("--compare-chunk-lengths", default="32768")
    ap.add_argument("--diagnose-attention", type=int, default=0,
                    help="length at which to time cuDNN on random vs real q/k/v, alone vs after a GEMM (0 = skip)")
    ap.add_argument("--skip-floor", action="store_true")
    ap.add_argument("--sustained-floor", default="", help="lengths at which to also time the floor's work "
                    "back to back (GEMMs at the engine's chunk rows + cuDNN attention, all layers)")
    ap.add_argument("--floor-reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_e2e.json")
    args = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    args.lengths, args.compare_unfused = ints(args.lengths), ints(args.compare_unfused)
    args.compare_chunk_lengths = ints(args.compare_chunk_lengths) if args.compare_chunk else []
    args.sustained_floor = ints(args.sustained_floor)
    args.throughput_densities = [float(x) for x in args.throughput_densities.split(",") if x.strip()]
    args.tp = None
    if args.throughput:
        n, l = args.throughput.lower().split("x")
        args.tp = (int(n), int(l))
    return args


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cfg = model_config(args.preset)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    t_start = time.perf_counter()
    model = random_model(cfg, device, dtype, args.seed)
    if args.chunk_tokens:
        model.chunk_tokens = args.chunk_tokens
    chunk = model.chunk_tokens
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # the pool holds the longest prompt, or the throughput run's requests in flight
    pool_tokens = max(args.lengths + [args.check_len, args.profile_len] + args.compare_unfused
                      + args.compare_chunk_lengths)
    if args.tp:
        n, l = args.tp
        pool_tokens = max(pool_tokens, (args.token_budget // l + 1) * l)
    bs = args.block_size
    pool = KVPool(cfg.num_layers, (pool_tokens + bs - 1) // bs + 1, cfg.num_kv_heads, bs, cfg.head_dim, dtype, device)
    res: dict = {"bench": "e2e", "meta": {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "prefill-server bench e2e " + " ".join(args.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": _version("triton"), "preset": args.preset, "dtype": args.dtype,
        "model": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                 "head_dim", "intermediate_size", "vocab_size", "rope_theta")},
        "block_size": bs, "chunk_tokens": chunk,
        "fused_kernels": bool(fused is not None and fused.available(torch.empty(0, device=device))),
        "weights_gib": weights / 2**30, "pool_gib": pool.kv.numel() * pool.kv.element_size() / 2**30,
        "pool_tokens": pool.num_blocks * bs, "targets": {"ttft_over_floor": TARGET_RATIO,
                                                          "throughput_of_linear_floor": TARGET_THROUGHPUT}}}
    res["phases"] = []  # (name, unix time at its start): to line up with nvidia-smi samples

    def log(*a):
        print(*a, file=sys.stderr, flush=True)

    def mark(name):
        res["phases"].append([name, time.time()])
    log(f"model + pool ready in {time.perf_counter() - t_start:.1f} s: {res['meta']['weights_gib']:.1f} GiB weights, "
        f"{res['meta']['pool_gib']:.1f} GiB pool")

    if device.type == "cuda":
        res["check_fused"] = check_fused(cfg, device, dtype)
        log("check_fused", res["check_fused"])
    if args.check_len:
        mark("check")
        res["check"] = check_engine(model, cfg, pool, device, args.check_len,
                                    fp32=bool(args.check_fp32) and device.type == "cuda")
        log("check", res["check"])

    floor = None
    if not args.skip_floor:
        mark("floor")
        fl = Floor(model, cfg, device, dtype, args.floor_reps)
        res["matmul_peak"] = matmul_peak(device, dtype, 8192 if device.type == "cuda" else 256, args.floor_reps)
        res["floor"] = {}
        for t in sorted(set(args.lengths + ([args.tp[1]] if args.tp else []))):
            lin = fl.linear(t)
            att = fl.attention(t, args.floor_reps if t <= 65536 else 3)
            peak_linear_ms = lin["flops"] / res["matmul_peak"]["tflops"] / 1e9
            res["floor"][str(t)] = {"tokens": t, "linear": lin, "attention": att,
                                    "floor_s": (lin["ms"] + att["ms"]) / 1e3,
                                    "floor_at_peak_matmul_s": (peak_linear_ms + att["ms"]) / 1e3}
            log(f"floor {t}: linear {lin['ms']:.1f} ms ({lin['tflops']:.0f} TFLOP/s), attention {cfg.num_layers} x "
                f"{att['layer_ms']:.2f} ms = {att['ms']:.1f} ms")
            if t in args.sustained_floor:
                mark(f"sustained_floor_{t}")
                sf = fl.sustained(t, chunk)
                res["floor"][str(t)]["sustained"] = sf
                res["floor"][str(t)]["sustained_floor_s"] = sf["ms"] / 1e3
                log(f"sustained floor {t}: {sf['ms']:.1f} ms")
        floor = res["floor"]
    if args.diagnose_attention and device.type == "cuda":
        mark("diagnose_attention")
        res["attention_diagnostics"] = attention_diagnostics(model, cfg, device, dtype, args.diagnose_attention)
        log("attention diagnostics", res["attention_diagnostics"])

    engine = make_engine(model, cfg, pool, device, token_budget=max(args.lengths + [args.check_len]), max_num_seqs=1)
    res["ttft"] = []
    for t in args.lengths:
        warm = 1 if t <= args.warmup_max else 0
        mark(f"ttft_{t}")
        r = ttft_runs(engine, cfg, t, args.reps if warm else args.long_reps, warm, device, args.seed + t)
        if floor:
            f = floor[str(t)]
            r.update(floor_s=f["floor_s"], ratio=r["ttft_s"] / f["floor_s"],
                     ratio_vs_peak_matmul_floor=r["ttft_s"] / f["floor_at_peak_matmul_s"],
                     pass_target=r["ttft_s"] / f["floor_s"] <= TARGET_RATIO)
            if "sustained_floor_s" in f:
                r["ratio_vs_sustained_floor"] = r["ttft_s"] / f["sustained_floor_s"]
        res["ttft"].append(r)
        log("ttft", {k: v for k, v in r.items() if k != "engine_total_s"})
    if args.compare_chunk:
        res["ttft_chunk"] = []
        model.chunk_tokens = args.compare_chunk
        try:
            for t in args.compare_chunk_lengths:
                mark(f"ttft_chunk{args.compare_chunk}_{t}")
                r = ttft_runs(engine, cfg, t, args.reps, 1, device, args.seed + t)
                r["chunk_tokens"] = args.compare_chunk
                if floor and str(t) in floor:
                    r["ratio"] = r["ttft_s"] / floor[str(t)]["floor_s"]
                res["ttft_chunk"].append(r)
                log("ttft chunk", r)
        finally:
            model.chunk_tokens = chunk
    if args.compare_unfused and fused is not None:
        mark("ttft_unfused")
        res["ttft_unfused"] = []
        with fused.enabled(False):
            for t in args.compare_unfused:
                r = ttft_runs(engine, cfg, t, args.reps, 1, device, args.seed + t)
                if floor and str(t) in floor:
                    r["ratio"] = r["ttft_s"] / floor[str(t)]["floor_s"]
                res["ttft_unfused"].append(r)
                log("ttft unfused", r)
    if args.profile_len:
        mark("profile")
        res["profile"] = profile_prefill(engine, cfg, args.profile_len, device)
        log("profile", json.dumps(res["profile"]["by_category_ms"]))
    if args.tp:
        n, l = args.tp
        mark("throughput")
        tp_engine = make_engine(model, cfg, pool, device, token_budget=args.token_budget, max_num_seqs=n)
        r = throughput_run(tp_engine, cfg, n, l, device, args.seed + 7)
        if floor:  # every request's linear layers (lm_head included) at the floor's rate
            lin_ms = n * floor[str(l)]["linear"]["ms"]
            r.update(linear_floor_s=lin_ms / 1e3, of_linear_floor=lin_ms / 1e3 / r["wall_s"],
                     attention_floor_s=n * floor[str(l)]["attention"]["ms"] / 1e3,
                     pass_target=lin_ms / 1e3 / r["wall_s"] >= TARGET_THROUGHPUT)
        res["throughput"] = r
        log("throughput", {k: v for k, v in r.items() if k != "steps"})
        if args.throughput_floor and not args.skip_floor:
            mark("throughput_floor")
            step_tokens = (args.token_budget // l) * l
            n_steps = n * l / step_tokens
            both = fl.sustained(step_tokens, chunk, attn_len=l)
            gemms = fl.sustained(step_tokens, chunk, attention=False)
            r["step_floor"] = {"step_tokens": step_tokens, "steps": n_steps, "sustained": both,
                               "sustained_gemms_only": gemms,
                               "sustained_floor_s": both["ms"] * n_steps / 1e3,
                               "sustained_linear_s": gemms["ms"] * n_steps / 1e3}
            if floor:
                r["step_floor"]["of_linear_floor_if_at_sustained_floor"] = lin_ms / both["ms"] / n_steps
            log("throughput step floor", {k: v for k, v in r["step_floor"].items() if not isinstance(v, dict)})
        if args.throughput_densities:
            from prefill_server.bench.stream import BenchSparse  # (it imports this module)
            r["sparse"] = []
            for d in args.throughput_densities:
                mark(f"throughput_sparse_{d:g}")
                sp = BenchSparse(density=d, seed=args.seed)
                sp.prepare(l, cfg.num_kv_heads, cfg.head_dim, device)
                tp_engine.runner.sparse = sp
                try:
                    drive(tp_engine, [PrefillRequest("tp-sparse-warmup", tuple(range(1, l + 1)))])
                    rs = throughput_run(tp_engine, cfg, n, l, device, args.seed + 8)
                finally:
                    tp_engine.runner.sparse = None
                rs.update(kernel_density=sp.mask_density.get(l), mode=sp.label,
                          dense_first_layers=sp.config.first_dense_layers(l))
                sp.take_densities()
                if floor:
                    rs["of_linear_floor"] = lin_ms / 1e3 / rs["wall_s"]
                r["sparse"].append(rs)
                log("throughput sparse", {k: v for k, v in rs.items() if k != "steps"})
        if args.profile_throughput:
            mark("profile_throughput")
            r["profile"] = profile_prefill(tp_engine, cfg, l, device, requests=args.profile_throughput)
            log("profile throughput", json.dumps(r["profile"]["by_category_ms"]),
                f"busy {r['profile']['gpu_busy_ms']:.0f} of {r['profile']['wall_ms_with_profiler']:.0f} ms")
    mark("end")
    res["meta"]["elapsed_s"] = time.perf_counter() - t_start
    return res


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:
        return None


def table(res: dict) -> str:
    lines = [f"{'tokens':>8} {'TTFT s':>9} {'floor s':>9} {'ratio':>6} {'linear s':>9} {'attn s':>8} {'peak GiB':>9}"]
    for r in res.get("ttft", []):
        f = res.get("floor", {}).get(str(r["tokens"]))
        lin = f"{f['linear']['ms'] / 1e3:9.3f}" if f else f"{'-':>9}"
        att = f"{f['attention']['ms'] / 1e3:8.3f}" if f else f"{'-':>8}"
        fs = f"{r['floor_s']:9.3f}" if "floor_s" in r else f"{'-':>9}"
        ratio = f"{r['ratio']:6.3f}" if "ratio" in r else f"{'-':>6}"
        lines.append(f"{r['tokens']:>8} {r['ttft_s']:9.3f} {fs} {ratio} {lin} {att} {r['peak_mem_gib']:9.1f}")
    for r in res.get("ttft", []):
        if "ratio_vs_sustained_floor" in r:
            sf = res["floor"][str(r["tokens"])]["sustained_floor_s"]
            lines.append(f"{r['tokens']:>8} vs the sustained floor {sf:.3f} s: ratio {r['ratio_vs_sustained_floor']:.3f}")
    for r in res.get("ttft_unfused", []):
        lines.append(f"{r['tokens']:>8} {r['ttft_s']:9.3f} (fused kernels off)")
    for r in res.get("ttft_chunk", []):
        lines.append(f"{r['tokens']:>8} {r['ttft_s']:9.3f} (chunk_tokens {r['chunk_tokens']})")
    tp = res.get("throughput")
    if tp:
        extra = f", {tp['of_linear_floor']:.0%} of the linear floor" if "of_linear_floor" in tp else ""
        lines.append(f"throughput {tp['requests']}x{tp['tokens_each']} (budget {tp['token_budget']}): "
                     f"{tp['wall_s']:.2f} s, {tp['tokens_per_s']:.0f} tok/s{extra}")
        for rs in tp.get("sparse", []):
            extra = f", {rs['of_linear_floor']:.0%} of the linear floor" if "of_linear_floor" in rs else ""
            lines.append(f"  sparse attention, {rs['mode']}: {rs['wall_s']:.2f} s{extra}")
        sf = tp.get("step_floor")
        if sf:
            lines.append(f"  its floor work back to back: {sf['sustained_floor_s']:.2f} s (GEMMs alone "
                         f"{sf['sustained_linear_s']:.2f} s)")
        if tp.get("profile"):
            pr = tp["profile"]
            lines.append(f"  profile of {pr['requests']} requests: GPU busy {pr['gpu_busy_ms']:.0f} of "
                         f"{pr['wall_ms_with_profiler']:.0f} ms: " + ", ".join(
                             f"{k} {v:.0f}" for k, v in pr["by_category_ms"].items()))
    if "matmul_peak" in res:
        lines.append(f"matmul {res['matmul_peak']['n']}^3: {res['matmul_peak']['tflops']:.0f} TFLOP/s")
    return "\n".join(lines)


def bench_args(parse, argv: list[str], name: str):
    """``parse(argv)`` with ``argv`` kept on it (for the JSON); None if it asks for a GPU that is absent."""
    args = parse(argv)
    args.argv = argv
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{name}: no CUDA GPU here (use --preset tiny --device cpu for a smoke run)", file=sys.stderr)
        return None
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["stream"]:  # sparse mode + KV streamed to a receiver process: bench/stream.py
        from prefill_server.bench.stream import main as stream_main
        return stream_main(argv[1:])
    args = bench_args(parse_args, argv, "bench e2e")
    if args is None:
        return 2
    res = run(args)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(table(res))
    print(f"wrote {args.out}")
    return 0  # the numbers (and their pass_target flags) are the output; a miss is not a crash


if __name__ == "__main__":
    raise SystemExit(main())

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

Parts: ``common.py`` (model, engine, timing, options shared with ``stream.py``), ``floor.py`` (the
floor), ``checks.py`` (correctness and attention diagnostics), ``sparse.py`` (the sparse adapter of
``--throughput-densities``); this module runs them and writes the JSON.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time

import torch

from prefill_server.bench.checks import attention_diagnostics, check_engine, check_fused
from prefill_server.bench.common import (_sync, _version, bench_args, drive, ints, make_engine, model_args,
                                         model_config, random_model)
from prefill_server.bench.floor import Floor, matmul_peak
from prefill_server.bench.gpu_clocks import ClockSampler
from prefill_server.config import FP8_ATTENTION, KV_CACHE_DTYPES
from prefill_server.engine.engine import Engine
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.types import PrefillRequest
from prefill_server.models.config import ModelConfig

try:  # absent in older trees (the bench also runs against them for a before/after)
    from prefill_server.layers import fused
except ImportError:  # pragma: no cover
    fused = None

TARGET_RATIO = 1.15
TARGET_THROUGHPUT = 0.80


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
    ap.add_argument("--quantization", default="none", choices=("none", "fp8"),
                    help="fp8: the projections in FP8, as serve --quantization fp8 (e2e: no floor, no check)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the KV pool's pages, as serve --kv-cache-dtype (fp8: e4m3 pages)")
    ap.add_argument("--fp8-attention", default="auto", choices=FP8_ATTENTION,
                    help="FP8 scores, as serve --fp8-attention (auto: with --kv-cache-dtype fp8)")
    ap.add_argument("--fp8-exact-accum", action="store_true", help="FP8 GEMMs without use_fast_accum")
    ap.add_argument("--out", default="bench_e2e.json")
    args = ap.parse_args(argv)
    args.lengths, args.compare_unfused = ints(args.lengths), ints(args.compare_unfused)
    args.compare_chunk_lengths = ints(args.compare_chunk_lengths) if args.compare_chunk else []
    args.sustained_floor = ints(args.sustained_floor)
    args.throughput_densities = [float(x) for x in args.throughput_densities.split(",") if x.strip()]
    if args.fp8_exact_accum:
        from prefill_server.layers.fp8 import Fp8Linear
        Fp8Linear.fast_accum = False
    if args.quantization != "none":  # the floor and the reference check time / compute bf16 GEMMs
        args.skip_floor, args.check_len, args.throughput_floor = True, 0, False
    if args.kv_cache_dtype != "auto":  # (the reference check compares with bf16 pages)
        args.check_len = 0
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
    model = random_model(cfg, device, dtype, args.seed, args.quantization)
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
    pool = KVPool(cfg.num_layers, (pool_tokens + bs - 1) // bs + 1, cfg.num_kv_heads, bs, cfg.head_dim, dtype, device,
                  cache_dtype=args.kv_cache_dtype)
    res: dict = {"bench": "e2e", "meta": {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "prefill-server bench e2e " + " ".join(args.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": _version("triton"), "preset": args.preset, "dtype": args.dtype,
        "quantization": args.quantization, "fp8_exact_accum": args.fp8_exact_accum,
        "kv_cache_dtype": args.kv_cache_dtype, "fp8_attention": args.fp8_attention,
        "model": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                 "head_dim", "intermediate_size", "vocab_size", "rope_theta")},
        "block_size": bs, "chunk_tokens": chunk,
        "fused_kernels": bool(fused is not None and fused.available(torch.empty(0, device=device))),
        "weights_gib": weights / 2**30, "pool_gib": pool.kv.numel() * pool.kv.element_size() / 2**30,
        "pool_tokens": pool.num_blocks * bs, "targets": {"ttft_over_floor": TARGET_RATIO,
                                                          "throughput_of_linear_floor": TARGET_THROUGHPUT}}}
    res["phases"] = []  # (name, unix time at its start): to line up with nvidia-smi samples
    clocks = ClockSampler(device.index).start() if device.type == "cuda" else None

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

    engine = make_engine(model, cfg, pool, device, token_budget=max(args.lengths + [args.check_len]), max_num_seqs=1,
                         fp8_attention=args.fp8_attention)
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
        tp_engine = make_engine(model, cfg, pool, device, token_budget=args.token_budget, max_num_seqs=n,
                                fp8_attention=args.fp8_attention)
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
            r["ratio_vs_sustained_floor"] = r["wall_s"] / r["step_floor"]["sustained_floor_s"]
            if floor:
                r["step_floor"]["of_linear_floor_if_at_sustained_floor"] = lin_ms / both["ms"] / n_steps
            log("throughput step floor", {k: v for k, v in r["step_floor"].items() if not isinstance(v, dict)})
        if args.throughput_densities:
            from prefill_server.bench.sparse import BenchSparse  # (the block-sparse kernels: only here)
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
    if clocks is not None:
        clocks.stop()
        res["clocks"] = clocks.by_phase(res["phases"])  # SM MHz and board W per phase
    return res


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
                         f"{sf['sustained_linear_s']:.2f} s): ratio {tp['ratio_vs_sustained_floor']:.3f}")
        if tp.get("profile"):
            pr = tp["profile"]
            lines.append(f"  profile of {pr['requests']} requests: GPU busy {pr['gpu_busy_ms']:.0f} of "
                         f"{pr['wall_ms_with_profiler']:.0f} ms: " + ", ".join(
                             f"{k} {v:.0f}" for k, v in pr["by_category_ms"].items()))
    if "matmul_peak" in res:
        lines.append(f"matmul {res['matmul_peak']['n']}^3: {res['matmul_peak']['tflops']:.0f} TFLOP/s")
    for name, c in res.get("clocks", {}).items():
        lines.append(f"clocks {name}: {c}" if name == "unavailable" else
                     f"clocks {name}: SM {c['sm_mhz_mean']} MHz (min {c['sm_mhz_min']:.0f}), "
                     f"{c['power_w_mean']} W (max {c['power_w_max']})")
    return "\n".join(lines)


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

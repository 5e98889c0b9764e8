"""Where the time of a prefix-cache hit goes (issue 17 follow-up): 256 new tokens over an 8,192-token
cached head, Llama-3.1-8B-shaped random bf16 weights, one H200.

Why this file is long: a one-off device experiment, one script per device call (its variants of the
attention and the graph runner live here, not in the package, until one is adopted).

Sections (all in one process, nvidia-smi sampled in the background every 50 ms):

1. ``engine``: the bench's cache-on run (docs/bench/2026-12-03-prefix-cache-h200/bench.py), requests
   one at a time through the running engine thread, at token budgets 16384 and 2048, with every
   phase of a request timed by wrappers installed here (submit + hashing, schedule + prefix lookup,
   runner.run's host time, the step's synchronize, sampling, hand-over, metrics, the caller's
   wake-up); then the same hits with 50 / 250 ms of idle before each.
2. ``direct``: the hit's forward alone (``ModelRunner.run`` on ``Chunk(seq, 8192, 8448)`` over the
   head's K/V in the pool), as it is and with variants patched in from here (nothing under
   prefill_server/ is edited): F1 the per-layer block index built once per step (no host sync per
   layer), F2 F1 + GQA attention without ``repeat_interleave`` (flash's native GQA), F3 F2 as one
   CUDA graph; each back to back and after idle gaps, with SM clock read before each.
3. ``profile``: torch.profiler of hits (as is and F2): kernel time by name, GPU busy vs wall, the
   host syncs, the largest idle gaps on the GPU.
4. ``parts``: the hit's pieces alone (GEMM-only forward, one layer's attention as is / per variant).
5. ``heat``: hits right after 20 whole 8,448-token forwards (what the bench's off run leaves behind).

    export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
    python3 docs/bench/2026-12-03-prefix-cache-profile/profile.py --out $OUT/profile.json
    .venv/bin/python docs/bench/2026-12-03-prefix-cache-profile/profile.py --preset tiny --device cpu \\
        --dtype float32 --head 256 --tail 32 --n 4 --out /tmp/prof.json       # smoke run
"""
from __future__ import annotations

import os
import sys

# this file's name shadows the standard library's ``profile`` (cProfile imports it, torch._dynamo
# imports cProfile): keep this folder off the import path
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import argparse
import datetime as _dt
import gc
import gzip
import json
import random
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future

import torch

from kv_transfer.base import Route
from prefill_server.bench.common import model_config, random_model
from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.engine import engine as engine_mod
from prefill_server.engine import runner as runner_mod
from prefill_server.engine.engine import Engine
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.local_producer import LocalProducer
from prefill_server.engine.runner import ModelRunner, PagedAttention
from prefill_server.engine.scheduler import Chunk, Scheduler, Sequence
from prefill_server.engine.types import PrefillRequest
from prefill_server.layers import attention as attn_mod

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def stats(xs: list[float], scale: float = 1e3) -> dict:
    xs = [x * scale for x in xs]
    if not xs:
        return {}
    s = sorted(xs)
    return {"n": len(xs), "mean": statistics.mean(xs), "median": statistics.median(xs), "min": s[0],
            "max": s[-1], "p90": s[min(len(s) - 1, int(0.9 * len(s)))],
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0}


# ---------------------------------------------------------------- GPU clock sampling
class Smi:
    """nvidia-smi -lms 50 in the background; marks tie its samples to sections."""

    def __init__(self, path: str):
        self.path, self.proc, self.marks = path, None, []
        q = "timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu,clocks_throttle_reasons.active"
        try:
            self.f = open(path, "w")
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits",
                                          "-lms", "50"], stdout=self.f, stderr=subprocess.DEVNULL)
        except Exception as e:  # CPU smoke run
            log(f"no nvidia-smi: {e}")

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time()))

    def stop(self) -> dict:
        if self.proc is None:
            return {}
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.f.close()
        rows = []
        for line in open(self.path):
            p = [x.strip() for x in line.split(",")]
            try:
                ts = _dt.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((ts, float(p[1]), float(p[2]), float(p[3]), float(p[4]), float(p[5]), p[6]))
            except Exception:
                continue
        # nvidia-smi prints local time; this process's time.time() is UTC epoch: same clock if TZ=UTC
        out = {}
        marks = self.marks + [("end", time.time())]
        for (name, a), (_, b) in zip(marks, marks[1:]):
            sel = [r for r in rows if a <= r[0] < b]
            if sel:
                sm = [r[1] for r in sel]
                pw = [r[3] for r in sel]
                out[name] = {"samples": len(sel), "sm_mhz_min": min(sm), "sm_mhz_median": statistics.median(sm),
                             "sm_mhz_max": max(sm), "power_w_median": statistics.median(pw),
                             "power_w_max": max(pw), "util_median": statistics.median([r[4] for r in sel]),
                             "temp_max": max(r[5] for r in sel),
                             "throttle_reasons": sorted({r[6] for r in sel})}
        return {"sections": out, "num_samples": len(rows)}


def sm_clock() -> int | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
    except Exception:
        return None


# ---------------------------------------------------------------- phase timers (engine section)
EVENTS: list[tuple[str, float, float, str]] = []  # (name, t0, t1, thread)


def timed(name: str, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            EVENTS.append((name, t0, time.perf_counter(), threading.current_thread().name))
    wrapper.__wrapped__ = fn
    return wrapper


def install_timers() -> None:
    engine_mod.prompt_hashes = timed("submit.prompt_hashes", engine_mod.prompt_hashes)
    Engine._submit = timed("submit.total", Engine._submit)
    Scheduler.schedule = timed("loop.schedule(+prefix lookup)", Scheduler.schedule)
    KVPool.acquire_prefix = timed("loop.acquire_prefix", KVPool.acquire_prefix)
    ModelRunner.run = timed("step.runner.run (host)", ModelRunner.run)
    Engine._synchronize = timed("step.synchronize (GPU tail)", Engine._synchronize)
    Scheduler.advance = timed("step.advance(+name blocks)", Scheduler.advance)
    engine_mod.sample_first_token = timed("finish.sample_first_token", engine_mod.sample_first_token)
    engine_mod.first_token_logprobs = timed("finish.first_token_logprobs", engine_mod.first_token_logprobs)
    Engine._hand_over[Route.LEASE] = timed("finish.hand_over(publish)", Engine._hand_over[Route.LEASE])
    # (refresh_metrics runs after the future is set: outside the TTFT, counted only when it overlaps)


# ---------------------------------------------------------------- variants of the hit path
_READ = KVPool.read
_DENSE = runner_mod.dense_attention
_IDX: dict = {}
GQA_FAILED: list[str] = []


def read_cached_idx(self, layer, block_ids, num_tokens):
    """F1: KVPool.read with the block index tensor built once per (blocks, length), not per layer:
    torch.tensor(list, device=cuda) is a pageable H2D copy plus cudaStreamSynchronize."""
    n = self.blocks_needed(num_tokens)
    key = (id(block_ids), n, block_ids[0], block_ids[n - 1])
    idx = _IDX.get(key)
    if idx is None:
        idx = _IDX[key] = torch.tensor(block_ids[:n], dtype=torch.long, device=self.device)
    pages = self.kv[layer].index_select(0, idx)
    flat = pages.permute(0, 2, 1, 3).reshape(-1, self.num_kv_heads, 2 * self.head_dim)[:num_tokens]
    return flat[..., : self.head_dim], flat[..., self.head_dim:]


def dense_gqa(q, k, v, scale):
    """F2: a later chunk (Tq < Tk) through flash's native GQA, bottom-right causal (flash's causal
    is bottom-right aligned), without repeat_interleave of K/V to 32 heads."""
    tq, tk = q.shape[0], k.shape[0]
    if not (q.is_cuda and tq < tk):
        return _DENSE(q, k, v, scale)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if GQA_FAILED:
        return _DENSE(q, k, v, scale)
    try:
        o = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, True, False, scale=scale)[0]
    except RuntimeError as e:  # this torch's flash takes no GQA: F2 is F1 then
        GQA_FAILED.append(repr(e)[:500])
        log(f"flash native GQA refused: {e!r}"[:400])
        return _DENSE(q, k, v, scale)
    return o[0].transpose(0, 1)


def set_variant(name: str) -> None:
    KVPool.read = _READ if name == "F0" else read_cached_idx
    runner_mod.dense_attention = dense_gqa if name in ("F2", "F3") else _DENSE
    _IDX.clear()


# ---------------------------------------------------------------- helpers
def make_engine(loaded, args, budget: int) -> Engine:
    bs = args.block_size
    tokens = args.head + args.n * args.tail * 4 + 2 * (args.head + args.tail) + 4 * bs
    cfg = EngineConfig(dtype=args.dtype, num_kv_blocks=-(-tokens // bs) + 8, block_size=bs, token_budget=budget,
                       prefix_cache=True)
    pool = build.make_pool(cfg, loaded)
    return Engine(build.make_runner(loaded, pool), pool, LocalProducer(pool, 600), max_model_len=131072,
                  vocab_size=loaded.config.vocab_size, token_budget=budget, max_num_seqs=8, max_queue_wait_s=600)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def engine_section(loaded, args, budget: int, prompts, warm, idles) -> dict:
    eng = make_engine(loaded, args, budget)
    warm_s = eng.warm_up(min(budget, args.head + args.tail))
    eng.start()
    out = {"token_budget": budget, "warm_up_forward_s": warm_s, "runs": {}}
    try:
        for i, ids in enumerate(warm):
            eng.submit(PrefillRequest(f"w{budget}-{i}", tuple(ids), num_logprobs=5)).result(timeout=600)
            eng.abort(f"w{budget}-{i}")
        for idle in idles:
            eng.reset_prefix_cache()
            reqs = []
            for i, ids in enumerate(prompts):
                if idle and i:
                    time.sleep(idle)
                rid = f"b{budget}-i{idle}-r{i}"
                req = PrefillRequest(rid, tuple(ids), num_logprobs=5)
                EVENTS.clear()
                clk = sm_clock()
                t0 = time.perf_counter()
                res = eng.submit(req).result(timeout=600)
                t1 = time.perf_counter()
                ev = list(EVENTS)
                eng.abort(rid)
                phases: dict[str, float] = {}
                for name, a, b, _ in ev:
                    if a >= t0 - 1e-4 and b <= t1 + 1e-4:
                        phases[name] = phases.get(name, 0.0) + (b - a)
                last_end = max((b for n, a, b, _ in ev if n == "finish.hand_over(publish)"), default=t1)
                phases["caller wake-up after hand-over"] = t1 - last_end
                sched = [a for n, a, b, _ in ev if n == "loop.schedule(+prefix lookup)" and a >= t0]
                sub_end = max((b for n, a, b, _ in ev if n == "submit.total"), default=t0)
                if sched:
                    phases["loop wake-up (submit -> schedule)"] = max(0.0, min(sched) - sub_end)
                reqs.append({"ttft_s": t1 - t0, "cached": res.num_cached_tokens, "sm_mhz_before": clk,
                             "engine_total_s": res.timings.total_s, "queued_s": res.timings.queued_s,
                             "phases_s": phases})
                log(f"engine b{budget} idle {idle}: r{i} {1e3 * (t1 - t0):.1f} ms cached {res.num_cached_tokens} "
                    f"run {1e3 * phases.get('step.runner.run (host)', 0):.1f} sync "
                    f"{1e3 * phases.get('step.synchronize (GPU tail)', 0):.1f} clk {clk}")
            hits = reqs[1:]
            names = sorted({k for r in hits for k in r["phases_s"]})
            out["runs"][f"idle_{idle}"] = {
                "requests": reqs, "ttft_hits_ms": stats([r["ttft_s"] for r in hits]),
                "ttft_first_ms": reqs[0]["ttft_s"] * 1e3,
                "phases_hits_mean_ms": {n: statistics.mean(r["phases_s"].get(n, 0.0) for r in hits) * 1e3
                                        for n in names},
                "phases_hits_max_ms": {n: max(r["phases_s"].get(n, 0.0) for r in hits) * 1e3 for n in names}}
    finally:
        eng.stop()
    del eng
    gc.collect()
    return out


class Hit:
    """The hit's forward alone: a sequence whose head's K/V are in the pool, run as Chunk(head, n)."""

    def __init__(self, loaded, args, prompt):
        self.dev = loaded.device
        n = len(prompt)
        self.n, self.head = n, args.head
        cfg = EngineConfig(dtype=args.dtype, num_kv_blocks=-(-n // args.block_size) + 2, block_size=args.block_size,
                           prefix_cache=False)
        self.pool = build.make_pool(cfg, loaded)
        self.runner = build.make_runner(loaded, self.pool)
        self.seq = Sequence(PrefillRequest("hit", tuple(prompt)), Future())
        self.seq.block_ids = self.pool.allocate(self.pool.blocks_needed(n))
        self.full = Chunk(self.seq, 0, n)
        self.chunk = Chunk(self.seq, args.head, n)
        self.runner.run([self.full])  # the head's K/V (and the tail's) in the pool
        sync(self.dev)
        self.graph = None

    def run(self):
        if self.graph is not None:
            self.graph.replay()
            return self.g_out
        return self.runner.run([self.chunk])

    def capture(self):
        """F3: the whole hit forward as one CUDA graph (static ids, positions, slot mapping, index)."""
        c, r = self.chunk, self.runner
        ids = torch.tensor(self.seq.request.prompt_token_ids[c.start:c.end], dtype=torch.long, device=self.dev)
        pos = torch.arange(c.start, c.end, device=self.dev)
        sl = runner_mod._SeqSlice(0, c.end - c.start, c.start, c.end, self.seq.block_ids)
        attn = PagedAttention(self.pool, [sl], r.scale)
        idx = torch.tensor([c.end - c.start - 1], dtype=torch.long, device=self.dev)
        read_cached_idx(self.pool, 0, self.seq.block_ids, c.end)  # index built before capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.inference_mode():
            for _ in range(2):
                r.model(ids, pos, attn, idx)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.inference_mode():
            self.g_out = r.model(ids, pos, attn, idx)
        self.graph = g

    def close(self):
        self.graph = None
        self.pool.free(self.seq.block_ids)


def time_hits(hit: Hit, reps: int, idle: float = 0.0, clocks: bool = False) -> dict:
    dev = hit.dev
    wall, gpu, host, clk = [], [], [], []
    for i in range(reps):
        if idle:
            time.sleep(idle)
        if clocks:
            clk.append(sm_clock())
        sync(dev)
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        hit.run()
        t1 = time.perf_counter()
        if dev.type == "cuda":
            e1.record()
        sync(dev)
        t2 = time.perf_counter()
        wall.append(t2 - t0)
        host.append(t1 - t0)
        if dev.type == "cuda":
            gpu.append(e0.elapsed_time(e1) / 1e3)
    out = {"wall_ms": stats(wall), "host_return_ms": stats(host), "wall_all_ms": [round(x * 1e3, 3) for x in wall]}
    if gpu:
        out["events_ms"] = stats(gpu)
    if clocks:
        out["sm_mhz_before"] = clk
    return out


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def trace_analysis(path: str, label: str) -> dict:
    with open(path) as f:
        tr = json.load(f)
    evs = tr.get("traceEvents", tr) if isinstance(tr, dict) else tr
    kern = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in evs
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    rt = [e for e in evs if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    marks = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs
                   if e.get("ph") == "X" and e.get("name") == label and e.get("cat") == "user_annotation")
    res = []
    for a, b in marks:
        ks = [k for k in kern if k[0] >= a and k[0] < b + 50_000]  # kernels launched in the region
        if not ks:
            continue
        busy, cur_s, cur_e, gaps = 0.0, ks[0][0], ks[0][1], []
        for s, e, name in ks[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                gaps.append((s - cur_e, name))
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        by_name: dict[str, float] = {}
        for s, e, name in ks:
            short = name[:90]
            by_name[short] = by_name.get(short, 0.0) + (e - s)
        rts = [e for e in rt if a <= e["ts"] <= b]
        rt_by: dict[str, list] = {}
        for e in rts:
            rt_by.setdefault(e["name"], []).append(e["dur"])
        res.append({"host_region_us": b - a, "gpu_span_us": ks[-1][1] - ks[0][0], "gpu_busy_us": busy,
                    "gpu_first_kernel_after_region_start_us": ks[0][0] - a,
                    "num_kernels": len(ks), "num_gaps_over_20us": sum(g > 20 for g, _ in gaps),
                    "gap_total_us": sum(g for g, _ in gaps),
                    "largest_gaps_us": [(round(g, 1), n[:60]) for g, n in sorted(gaps, reverse=True)[:8]],
                    "kernel_us_by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:20]),
                    "runtime_calls": {n: {"count": len(d), "total_us": sum(d)} for n, d in
                                      sorted(rt_by.items(), key=lambda kv: -sum(kv[1]))[:12]}})
    return {"regions": res}


def profile_hits(hit: Hit, label: str, reps: int, outdir: str) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if hit.dev.type == "cuda" else [])
    for _ in range(2):
        hit.run()
    sync(hit.dev)
    with profile(activities=acts) as prof:
        for _ in range(reps):
            with record_function(label):
                hit.run()
            sync(hit.dev)
            time.sleep(0.002)
    tmp = os.path.join(tempfile.gettempdir(), f"trace_{label}.json")
    prof.export_chrome_trace(tmp)
    out = trace_analysis(tmp, label)
    with open(tmp, "rb") as f, gzip.open(os.path.join(outdir, f"trace_{label}.json.gz"), "wb") as g:
        g.write(f.read())
    ka = prof.key_averages()
    sort = "cuda_time_total" if hit.dev.type == "cuda" else "cpu_time_total"
    try:
        out["table"] = ka.table(sort_by=sort, row_limit=25, max_name_column_width=70)
    except Exception as e:
        out["table"] = str(e)
    return out


def parts_section(hit: Hit, loaded, args) -> dict:
    """One layer's attention for the hit as is and per variant, and the forward without attention."""
    if hit.dev.type != "cuda":
        return {}
    import triton.testing as tt
    mc = loaded.config
    T = args.tail
    g = torch.Generator(device=hit.dev).manual_seed(1)
    q = torch.randn(T, mc.num_heads, mc.head_dim, device=hit.dev, dtype=loaded.dtype, generator=g)
    k = torch.randn(T, mc.num_kv_heads, mc.head_dim, device=hit.dev, dtype=loaded.dtype, generator=g)
    v = torch.randn_like(k)
    pool, bl, n = hit.pool, hit.seq.block_ids, hit.n
    scale = mc.head_dim ** -0.5
    blocks, offsets = pool.slot_mapping(bl, args.head, n)
    res = {}

    def bench(name, fn):
        fn()
        torch.cuda.synchronize()
        res[name] = tt.do_bench(fn, warmup=25, rep=150, return_mode="median")

    set_variant("F0")
    bench("write_kv", lambda: pool.write(5, blocks, offsets, k, v))
    bench("read F0 (per-call H2D index + gather + permute copy)", lambda: _READ(pool, 5, bl, n))
    bench("read F1 (cached index)", lambda: read_cached_idx(pool, 5, bl, n))
    ks, vs = read_cached_idx(pool, 5, bl, n)
    rep = mc.num_heads // mc.num_kv_heads
    kh, vh = ks.transpose(0, 1)[None], vs.transpose(0, 1)[None]
    bench("repeat_interleave K and V", lambda: (kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)))
    bench("sdpa as is (_sdpa_gpu, incl. repeat_interleave)", lambda: attn_mod._sdpa_gpu(q, ks, vs, scale))
    bench("sdpa flash native GQA (F2)", lambda: dense_gqa(q, ks, vs, scale))
    ref = attn_mod._sdpa_gpu(q, ks, vs, scale)
    res["rel_err F2 vs as-is"] = rel(dense_gqa(q, ks, vs, scale), ref)
    # which kernel the as-is call runs
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        attn_mod._sdpa_gpu(q, ks, vs, scale)
        torch.cuda.synchronize()
    res["as_is_kernels"] = sorted({e.key[:100] for e in prof.key_averages()})
    # the hit forward with attention replaced by a no-op (GEMMs + elementwise + lm_head only)
    r = hit.runner
    c = hit.chunk
    ids = torch.tensor(hit.seq.request.prompt_token_ids[c.start:c.end], dtype=torch.long, device=hit.dev)
    pos = torch.arange(c.start, c.end, device=hit.dev)
    idx = torch.tensor([T - 1], dtype=torch.long, device=hit.dev)
    with torch.inference_mode():
        bench("forward without attention (GEMMs, norms, rope, lm_head)",
              lambda: r.model(ids, pos, lambda layer, q_, k_, v_: q_, idx))
    return res


# ---------------------------------------------------------------- G: the engine with hits as CUDA graphs
class GraphAttention:
    """attn(layer, q, k, v) over static buffers, for capture: K/V written at the slot mapping, the
    sequence's blocks gathered through a padded block table (``nbb`` entries, bucketed), attention
    by torch's varlen flash (native GQA, bottom-right causal, key count read from ``cu_k`` on the
    device: one graph serves every cached length in the bucket)."""

    def __init__(self, pool: KVPool, t: int, nbb: int, scale: float, dense_end: int | None = None):
        dev = pool.device
        self.pool, self.t, self.nbb, self.scale = pool, t, nbb, scale
        self.dense_end = dense_end  # "dense": exact key count, torch's split-KV flash (one graph per length)
        self.blocks = torch.zeros(t, dtype=torch.long, device=dev)
        self.offsets = torch.zeros(t, dtype=torch.long, device=dev)
        self.table = torch.zeros(nbb, dtype=torch.long, device=dev)
        self.cu_q = torch.tensor([0, t], dtype=torch.int32, device=dev)
        self.cu_k = torch.zeros(2, dtype=torch.int32, device=dev)

    def __call__(self, layer, q, k, v):
        p = self.pool
        p.write(layer, self.blocks, self.offsets, k, v)
        pages = p.kv[layer].index_select(0, self.table)  # [nbb, H, N, 2D]
        flat = pages.permute(0, 2, 1, 3).reshape(-1, p.num_kv_heads, 2 * p.head_dim)
        d = p.head_dim
        if self.dense_end is not None:
            kv = flat[:self.dense_end]
            return dense_gqa(q, kv[..., :d], kv[..., d:], self.scale)
        o = torch.ops.aten._flash_attention_forward(q, flat[..., :d], flat[..., d:], self.cu_q, self.cu_k, self.t,
                                                    self.nbb * p.block_size, 0.0, True, False, scale=self.scale)[0]
        return o


class GraphRunner:
    """ModelRunner.run for a step of one later chunk of <= MAX_T tokens (a prefix-cache hit): one
    CUDA graph per (T, block bucket), inputs copied into its static buffers, replayed."""
    MAX_T, BUCKET = 512, 64

    def __init__(self, runner: ModelRunner, mode: str = "varlen"):
        self.r, self.graphs, self.captures, self.replays = runner, {}, 0, 0
        self.mode = mode

    def applies(self, chunks) -> bool:
        c = chunks[0]
        return (len(chunks) == 1 and not c.seq.streams and c.start > 0 and c.is_last
                and c.end - c.start <= self.MAX_T and self.r.device.type == "cuda")

    @torch.inference_mode()
    def run(self, chunks):
        c = chunks[0]
        pool, dev = self.r.pool, self.r.device
        t = c.end - c.start
        need = pool.blocks_needed(c.end)
        dense = self.mode == "dense"
        nbb = need if dense else -(-need // self.BUCKET) * self.BUCKET
        key = (t, c.end) if dense else (t, nbb)
        g = self.graphs.get(key)
        if g is None:
            attn = GraphAttention(pool, t, nbb, self.r.scale, c.end if dense else None)
            g = {"attn": attn, "ids": torch.zeros(t, dtype=torch.long, device=dev),
                 "pos": torch.zeros(t, dtype=torch.long, device=dev),
                 "last": torch.tensor([t - 1], dtype=torch.long, device=dev),
                 "host": torch.zeros(3 * t + nbb + 2, dtype=torch.long).pin_memory(),
                 "dev": torch.zeros(3 * t + nbb + 2, dtype=torch.long, device=dev)}
        # inputs, one pinned host buffer -> one async copy -> split on the device
        bs = pool.block_size
        h = g["host"]
        pos = torch.arange(c.start, c.end)
        table = list(c.seq.block_ids[:need]) + [c.seq.block_ids[0]] * (nbb - need)
        h[:t] = torch.tensor(c.seq.request.prompt_token_ids[c.start:c.end])
        h[t:2 * t] = pos
        tbl = torch.tensor(table, dtype=torch.long)
        h[2 * t:3 * t] = tbl[pos // bs] * bs + pos % bs  # (block, offset) packed
        h[3 * t:3 * t + nbb] = tbl
        h[3 * t + nbb:] = torch.tensor([0, c.end])
        d = g["dev"]
        d.copy_(h, non_blocking=True)
        a = g["attn"]
        g["ids"].copy_(d[:t])
        g["pos"].copy_(d[t:2 * t])
        torch.div(d[2 * t:3 * t], bs, rounding_mode="floor", out=a.blocks)
        torch.remainder(d[2 * t:3 * t], bs, out=a.offsets)
        a.table.copy_(d[3 * t:3 * t + nbb])
        a.cu_k.copy_(d[3 * t + nbb:])
        if "graph" not in g:
            model = self.r.model
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    model(g["ids"], g["pos"], a, g["last"])
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                g["out"] = model(g["ids"], g["pos"], a, g["last"])
            g["graph"] = graph
            self.graphs[key] = g
            self.captures += 1
        g["graph"].replay()
        self.replays += 1
        torch.cuda.current_stream().synchronize()  # (the host buffer is reused by the next step)
        return g["out"].clone()


def graph_check(loaded, args, prompt) -> dict:
    """GraphRunner against the eager runner on the hit chunk (capture), its step time, and a second
    chunk of another cached length in the same block bucket (the same graph replayed)."""
    from prefill_server.layers import fused
    x = torch.randn(args.tail, loaded.config.hidden_size, device=loaded.device, dtype=loaded.dtype)
    w = torch.ones(loaded.config.hidden_size, device=loaded.device, dtype=loaded.dtype)
    launch = {}
    for name, fn in [("triton rms_norm launch", lambda: fused.rms_norm(x, w, 1e-5)),
                     ("torch add launch", lambda: torch.add(x, x)),
                     ("torch mm launch", lambda: torch.mm(x, x.t()))]:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        launch[name + " (host us)"] = (time.perf_counter() - t0) / 500 * 1e6
        torch.cuda.synchronize()
    hit = Hit(loaded, args, prompt)
    ref = hit.runner.run([hit.chunk]).float()
    out = {"launch_cost": launch, "eager_step_back_to_back": time_hits(hit, args.reps)}
    for mode in ("dense", "varlen"):
        gr = GraphRunner(hit.runner, mode)
        try:
            got = gr.run([hit.chunk]).float()
            stepf = type("H", (), {"dev": hit.dev, "run": lambda self, _g=gr: _g.run([hit.chunk])})()
            out[mode] = {"rel_err_vs_eager": rel(got, ref), "argmax_eq": bool(got.argmax() == ref.argmax()),
                         "graph_step_back_to_back": time_hits(stepf, args.reps),
                         "graph_step_idle_0.25": time_hits(stepf, 8, 0.25, clocks=True)}
        except Exception as e:
            import traceback
            out[mode] = {"error": repr(e), "tb": traceback.format_exc()[-2000:]}
        for b in gr.graphs.values():
            b.pop("graph", None)
    ok = [m for m in ("dense", "varlen") if "error" not in out[m]]
    if not ok:
        out["error"] = "no graph mode worked"
        return out
    out["chosen"] = min(ok, key=lambda m: out[m]["graph_step_back_to_back"]["wall_ms"]["median"])
    gr = GraphRunner(hit.runner, "varlen" if "varlen" in ok else ok[0])
    gr.run([hit.chunk])
    # another length in the same bucket: positions [head - 192, head + 64) of a shorter prompt
    s0, e0 = args.head - 192, args.head + 64
    seq2 = Sequence(PrefillRequest("hit2", tuple(prompt[:e0])), Future())
    seq2.block_ids = hit.seq.block_ids[:hit.pool.blocks_needed(e0)]
    c2 = Chunk(seq2, s0, e0)
    ref2 = hit.runner.run([c2]).float()
    got2 = gr.run([c2]).float()
    out.update(other_length_mode=gr.mode, other_length_rel_err=rel(got2, ref2), other_length_argmax_eq=bool(got2.argmax() == ref2.argmax()),
               captures_total=gr.captures, graph_keys=[list(k) for k in gr.graphs])
    for b in gr.graphs.values():
        b.pop("graph", None)
    hit.close()
    del hit, gr
    gc.collect()
    torch.cuda.empty_cache()
    return out


def graph_section(loaded, args, prompts, warm) -> dict:
    """The bench's cache-on run at budget 16384 three ways in one process: off (reference), eager
    on, graph on (GraphRunner patched into the engine's runner); then graph on with 250 ms idle."""
    budget = int(args.budgets.split(",")[0])
    out = {}
    if loaded.device.type == "cuda":
        try:
            out["check"] = graph_check(loaded, args, prompts[0])
        except Exception as e:
            import traceback
            out["check"] = {"error": repr(e), "tb": traceback.format_exc()[-3000:]}
        log(f"graph check: {json.dumps(out['check'], default=str)[:1200]}")
        if "error" in out["check"]:
            return out
    chosen = out.get("check", {}).get("chosen", "varlen")
    eager_first = None
    for mode in ("off", "eager_on", "graph_on", "graph_on_idle_0.25"):
        bs = args.block_size
        tokens = args.head + args.n * args.tail + 2 * (args.head + args.tail) + 4 * bs
        cfg = EngineConfig(dtype=args.dtype, num_kv_blocks=-(-tokens // bs) + 8, block_size=bs, token_budget=budget,
                           prefix_cache=mode != "off")
        pool = build.make_pool(cfg, loaded)
        runner = build.make_runner(loaded, pool)
        gr = None
        if mode.startswith("graph"):
            gr = GraphRunner(runner, chosen)
            orig = runner.run
            runner.run = lambda chunks, _o=orig, _g=gr: _g.run(chunks) if _g.applies(chunks) else _o(chunks)
        eng = Engine(runner, pool, LocalProducer(pool, 600), max_model_len=131072,
                     vocab_size=loaded.config.vocab_size, token_budget=budget, max_num_seqs=8, max_queue_wait_s=600)
        eng.warm_up(min(budget, args.head + args.tail))
        eng.start()
        ttft, first, cached = [], [], []
        try:
            for i, ids in enumerate(warm):  # (the graph is captured here, on the warm head's hit)
                eng.submit(PrefillRequest(f"gw{i}", tuple(ids), num_logprobs=5)).result(timeout=600)
                eng.abort(f"gw{i}")
            eng.reset_prefix_cache()
            for i, ids in enumerate(prompts):
                if mode.endswith("idle_0.25") and i:
                    time.sleep(0.25)
                t0 = time.perf_counter()
                res = eng.submit(PrefillRequest(f"g{i}", tuple(ids), num_logprobs=5)).result(timeout=600)
                ttft.append(time.perf_counter() - t0)
                first.append(res.first_token_id)
                cached.append(res.num_cached_tokens)
                eng.abort(f"g{i}")
        finally:
            eng.stop()
        r = {"ttft_ms_all": [round(x * 1e3, 3) for x in ttft], "ttft_ms": stats(ttft),
             "ttft_hits_ms": stats(ttft[1:]), "first_tokens": first, "cached": cached}
        if gr is not None:
            r.update(captures=gr.captures, replays=gr.replays, graph_mode=gr.mode)
        if mode == "eager_on":
            eager_first = first
        elif mode.startswith("graph") and eager_first is not None:
            r["same_first_tokens_as_eager_on"] = sum(a == b for a, b in zip(first, eager_first))
        out[mode] = r
        log(f"graph section {mode}: mean {r['ttft_ms']['mean']:.2f} ms, hits median {r['ttft_hits_ms']['median']:.2f} "
            f"[{r['ttft_hits_ms']['min']:.2f}-{r['ttft_hits_ms']['max']:.2f}] sd {r['ttft_hits_ms']['stdev']:.2f}")
        del eng, pool, runner, gr
        gc.collect()
        torch.cuda.empty_cache()
    out["ratio_mean_off_over_graph_on"] = out["off"]["ttft_ms"]["mean"] / out["graph_on"]["ttft_ms"]["mean"]
    out["ratio_mean_off_over_eager_on"] = out["off"]["ttft_ms"]["mean"] / out["eager_on"]["ttft_ms"]["mean"]
    return out


# ---------------------------------------------------------------- main
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b", choices=["llama-3.1-8b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--head", type=int, default=8192)
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budgets", default="16384,2048")
    ap.add_argument("--idles", default="0,0.05,0.25", help="seconds of idle before each request (engine section)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sections", default="engine,direct,profile,parts,heat",
                    help="also: graph (the engine with hits as CUDA graphs, off / eager / graph)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile.json"))
    args = ap.parse_args(argv)
    outdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(outdir, exist_ok=True)
    sections = set(args.sections.split(","))
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    smi = Smi(os.path.join(tempfile.gettempdir(), "smi.csv"))
    smi.mark("model")
    mcfg = model_config(args.preset)
    model = random_model(mcfg, device, dtype, seed=0)
    loaded = build.LoadedModel(f"random-{args.preset}-seed0", mcfg, model, None, dtype, device)
    log("model ready")
    rng = random.Random(0)
    V = mcfg.vocab_size
    lo = min(100, V // 4)

    def toks(n):
        return [rng.randrange(lo, V) for _ in range(n)]

    head = toks(args.head)
    prompts = [head + toks(args.tail) for _ in range(args.n)]
    warm_head = toks(args.head)
    warm = [warm_head + toks(args.tail) for _ in range(2)]
    out = {"command": " ".join(sys.argv), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "flash_attn_pkg": attn_mod.flash_attn_varlen_func is not None,
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cpu_cores": os.cpu_count(),
           "workload": f"hit: {args.tail} new tokens over a {args.head}-token cached head"}

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    if "engine" in sections:
        install_timers()
        idles = [float(x) for x in args.idles.split(",")]
        out["engine"] = []
        for b in [int(x) for x in args.budgets.split(",")]:
            smi.mark(f"engine_b{b}")
            out["engine"].append(engine_section(loaded, args, b, prompts, warm, idles if b == int(
                args.budgets.split(",")[0]) else [0.0]))
            save()
        # undo the wrappers
        for obj, name in [(engine_mod, "prompt_hashes"), (Engine, "_submit"), (Scheduler, "schedule"),
                          (KVPool, "acquire_prefix"), (ModelRunner, "run"), (Engine, "_synchronize"),
                          (Scheduler, "advance"), (engine_mod, "sample_first_token"),
                          (engine_mod, "first_token_logprobs")]:
            setattr(obj, name, getattr(obj, name).__wrapped__)
        Engine._hand_over[Route.LEASE] = Engine._hand_over[Route.LEASE].__wrapped__

    if "graph" in sections:
        smi.mark("graph")
        out["graph"] = graph_section(loaded, args, prompts, warm)
        save()
    hit = Hit(loaded, args, prompts[0]) if sections & {"direct", "profile", "parts", "heat"} else None
    if {"direct", "profile"} & sections:
        out["direct"] = {}
        logits = {}
        variants = ["F0", "F1", "F2"] + (["F3"] if device.type == "cuda" else [])
        for vname in variants:
            smi.mark(f"direct_{vname}")
            set_variant(vname)
            try:
                if vname == "F3":
                    hit.capture()
                for _ in range(3):
                    hit.run()
                sync(device)
                logits[vname] = hit.run().float().clone()
                d = {"back_to_back": time_hits(hit, args.reps)}
                if "direct" in sections:
                    d["idle_0.05"] = time_hits(hit, max(4, args.reps // 3), 0.05, clocks=True)
                    d["idle_0.25"] = time_hits(hit, max(4, args.reps // 3), 0.25, clocks=True)
                    d["back_to_back_again"] = time_hits(hit, args.reps)
                d["rel_err_logits_vs_F0"] = rel(logits[vname], logits["F0"])
                d["argmax_eq_F0"] = bool(logits[vname].argmax() == logits["F0"].argmax())
                if "profile" in sections:
                    smi.mark(f"profile_{vname}")
                    d["profile"] = profile_hits(hit, f"hit_{vname}", 3, outdir)
                out["direct"][vname] = d
                bb = d["back_to_back"]
                log(f"direct {vname}: wall {bb['wall_ms']['median']:.2f} ms (min {bb['wall_ms']['min']:.2f} max "
                    f"{bb['wall_ms']['max']:.2f}), host return {bb['host_return_ms']['median']:.2f} ms, events "
                    f"{bb.get('events_ms', {}).get('median', 0):.2f} ms; rel err vs F0 {d['rel_err_logits_vs_F0']:.3g}")
            except Exception as e:  # a variant that fails is reported, the rest go on
                import traceback
                out["direct"][vname] = {"error": repr(e), "tb": traceback.format_exc()[-3000:]}
                log(f"direct {vname} failed: {e!r}")
            finally:
                hit.graph = None
            save()
        set_variant("F0")
    if "parts" in sections:
        smi.mark("parts")
        try:
            out["parts_ms"] = parts_section(hit, loaded, args)
        except Exception as e:
            import traceback
            out["parts_ms"] = {"error": repr(e), "tb": traceback.format_exc()[-3000:]}
        log(f"parts: {json.dumps(out['parts_ms'], default=str)[:1500]}")
        save()
    if "heat" in sections:
        smi.mark("heat_full_forwards")
        t0 = time.perf_counter()
        for _ in range(20):
            hit.runner.run([hit.full])
        sync(device)
        full_s = (time.perf_counter() - t0) / 20
        smi.mark("heat_hits_after")
        set_variant("F0")
        out["heat"] = {"full_forward_ms": full_s * 1e3, "hits_after_F0": time_hits(hit, args.reps, clocks=True)}
        smi.mark("heat_rest")
        time.sleep(3)
        smi.mark("heat_hits_rested")
        out["heat"]["hits_after_3s_rest_F0"] = time_hits(hit, args.reps, clocks=True)
        log(f"heat: full {full_s * 1e3:.1f} ms; hits after {out['heat']['hits_after_F0']['wall_ms']['median']:.2f}"
            f" ms, after rest {out['heat']['hits_after_3s_rest_F0']['wall_ms']['median']:.2f} ms")
    if hit is not None:
        hit.close()
    out["flash_native_gqa_error"] = GQA_FAILED[:1]
    out["smi"] = smi.stop()
    out["wall_s"] = time.monotonic() - T0
    save()
    # summary table
    print("== engine (TTFT of hits, ms) ==")
    for e in out.get("engine", []):
        for k, r in e["runs"].items():
            t = r["ttft_hits_ms"]
            print(f"budget {e['token_budget']:5d} {k:10s} mean {t['mean']:6.2f} median {t['median']:6.2f} "
                  f"min {t['min']:6.2f} max {t['max']:6.2f} sd {t['stdev']:5.2f}")
            print("   phases (mean ms): " + ", ".join(f"{n} {v:.2f}" for n, v in r["phases_hits_mean_ms"].items()))
    print("== direct hit forward (ms) ==")
    for vname, d in out.get("direct", {}).items():
        if "error" in d:
            print(f"{vname}: ERROR {d['error']}")
            continue
        line = f"{vname}: b2b wall {d['back_to_back']['wall_ms']['median']:.2f} " \
               f"[{d['back_to_back']['wall_ms']['min']:.2f}-{d['back_to_back']['wall_ms']['max']:.2f}]"
        for k in ("idle_0.05", "idle_0.25", "back_to_back_again"):
            if k in d:
                line += f" | {k} {d[k]['wall_ms']['median']:.2f} [{d[k]['wall_ms']['min']:.2f}-{d[k]['wall_ms']['max']:.2f}]"
        line += f" | host {d['back_to_back']['host_return_ms']['median']:.2f} | rel {d['rel_err_logits_vs_F0']:.3g}"
        print(line)
        for reg in d.get("profile", {}).get("regions", [])[:1]:
            print(f"   profile: host {reg['host_region_us'] / 1e3:.2f} ms, gpu span {reg['gpu_span_us'] / 1e3:.2f} "
                  f"busy {reg['gpu_busy_us'] / 1e3:.2f} ms, {reg['num_kernels']} kernels, gaps "
                  f"{reg['gap_total_us'] / 1e3:.2f} ms; syncs "
                  f"{reg['runtime_calls'].get('cudaStreamSynchronize', {}).get('count', 0)}")
    if "parts_ms" in out:
        print("== parts ==")
        for k, v in out["parts_ms"].items():
            print(f"   {k}: {v if not isinstance(v, float) else round(v, 4)}")
    if "heat" in out:
        print(f"== heat == {json.dumps({k: (v['wall_ms'] if isinstance(v, dict) else v) for k, v in out['heat'].items()})[:600]}")
    gc_ = out.get("graph", {}).get("check")
    if gc_:
        print("graph check: " + json.dumps({k: (v if not isinstance(v, dict) else {
            kk: (vv["wall_ms"]["median"] if isinstance(vv, dict) and "wall_ms" in vv else vv)
            for kk, vv in v.items() if kk != "tb"}) for k, v in gc_.items()}, default=str)[:2500])
    for mode, r in out.get("graph", {}).items():
        if mode == "check":
            continue
        if isinstance(r, dict):
            print(f"graph {mode:20s}: mean {r['ttft_ms']['mean']:7.2f} ms (all 32), hits median "
                  f"{r['ttft_hits_ms']['median']:6.2f} [{r['ttft_hits_ms']['min']:6.2f}-{r['ttft_hits_ms']['max']:6.2f}] "
                  f"sd {r['ttft_hits_ms']['stdev']:5.2f}; same first tokens as eager "
                  f"{r.get('same_first_tokens_as_eager_on')}; captures {r.get('captures')}")
        else:
            print(f"graph {mode}: {r:.2f}")
    print(f"smi: {json.dumps(out['smi'].get('sections', {}))[:3000]}")
    print(f"wall {out['wall_s']:.1f} s")


if __name__ == "__main__":
    main()

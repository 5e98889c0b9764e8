"""Issue 17's GPU bar: 32 requests sharing an 8K-token head, each with its own 256-token tail, one at
a time through the engine (Llama-3.1-8B-shaped random bf16 weights, transfer mode local: the lease
is released at once, as a decode's read would): TTFT (submit -> KV leased, first token sampled) with
the prefix cache off and on, the hit rate, and whether every request's first token is the same.

Same structure as the CPU bench (docs/bench/2026-12-02-prefix-cache/bench.py): one engine per
(token budget, cache) run, warm-up forwards, requests submitted one after the other to the running
engine thread, each released before the next. Added for the GPU: two untimed warm-up requests
through the engine before the timed ones (another head, two tails: the chunked path's kernels are
chosen there, not in the first timed request), then the prefix cache reset; the engine's own
prefix-cache counters next to num_cached_tokens; top-5 logprobs of each first token (a first token
that differs can be told from a near tie); the off and on paths' logits against the model in float32
for a few requests (``--fp32-check``); GPU name and clocks.

Budgets: 16384 (the default here: without the cache each 8448-token prompt is one step, one cuDNN
attention call per layer, the fastest "off") and 2048 (EngineConfig's default: chunked).

    python3 docs/bench/2026-12-03-prefix-cache-h200/bench.py --out $OUT/result.json         # the H200
    .venv/bin/python docs/bench/2026-12-03-prefix-cache-h200/bench.py --preset tiny --device cpu \\
        --dtype float32 --head 256 --tail 32 --n 4 --budgets 512,128 --out /tmp/pc.json    # smoke run
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import torch

from prefill_server.bench.common import _version, model_config, random_model
from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.engine.engine import Engine
from prefill_server.engine.local_producer import LocalProducer
from prefill_server.engine.types import PrefillRequest

BAR = 5.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def smi() -> dict | None:
    q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,memory.used"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip()
    except Exception as e:  # no nvidia-smi (CPU smoke run)
        return {"error": str(e)}
    return dict(zip(q.split(","), [x.strip() for x in out.split("\n")[0].split(",")])) if out else None


def counter(c) -> float:
    return c._value.get()


def run(loaded: build.LoadedModel, args, budget: int, cache: bool, prompts, warm) -> dict:
    bs = args.block_size
    tokens = args.head + args.n * args.tail + 2 * (args.head + args.tail) + 4 * bs
    cfg = EngineConfig(dtype=args.dtype, num_kv_blocks=-(-tokens // bs) + 8, block_size=bs, token_budget=budget,
                       prefix_cache=cache)
    pool = build.make_pool(cfg, loaded)
    if loaded.device.type == "cpu":
        build.configure_cpu(EngineConfig(cpu_threads=torch.get_num_threads(), cpu_attention="torch"), bs)
    eng = Engine(build.make_runner(loaded, pool), pool, LocalProducer(pool, 600), max_model_len=131072,
                 vocab_size=loaded.config.vocab_size, token_budget=budget, max_num_seqs=8, max_queue_wait_s=600)
    warm_s = eng.warm_up(min(budget, args.head + args.tail))
    eng.start()
    tag = f"budget {budget} cache {'on' if cache else 'off'}"
    ttft, engine_s, cached, first, logprobs = [], [], [], [], []
    try:
        warm_ttft = []
        for i, ids in enumerate(warm):  # untimed: another head, two tails
            t0 = time.monotonic()
            res = eng.submit(PrefillRequest(f"w{i}", tuple(ids), num_logprobs=5)).result(timeout=600)
            warm_ttft.append(time.monotonic() - t0)
            eng.abort(f"w{i}")
        eng.reset_prefix_cache()
        q0, h0 = counter(eng.metrics.prefix_cache_queries), counter(eng.metrics.prefix_cache_hits)
        for i, ids in enumerate(prompts):
            t0 = time.monotonic()
            res = eng.submit(PrefillRequest(f"r{i}", tuple(ids), num_logprobs=5)).result(timeout=600)
            ttft.append(time.monotonic() - t0)
            engine_s.append(res.timings.total_s)
            cached.append(res.num_cached_tokens)
            first.append(res.first_token_id)
            logprobs.append([[t, round(lp, 5)] for t, lp in res.first_logprobs])
            eng.abort(f"r{i}")  # the decode has read it
            log(f"{tag} r{i}: {ttft[-1] * 1e3:.1f} ms, {res.num_cached_tokens} cached, first {res.first_token_id}")
        queries = counter(eng.metrics.prefix_cache_queries) - q0
        hits = counter(eng.metrics.prefix_cache_hits) - h0
    finally:
        eng.stop()
    out = {"token_budget": budget, "prefix_cache": cache, "warm_up_forward_s": warm_s, "warm_requests_s": warm_ttft,
           "ttft_s": ttft, "engine_total_s": engine_s,
           "mean_ttft_s": statistics.mean(ttft), "median_ttft_s": statistics.median(ttft),
           "mean_ttft_after_first_s": statistics.mean(ttft[1:]) if len(ttft) > 1 else None,
           "min_ttft_s": min(ttft), "max_ttft_s": max(ttft),
           "cached_tokens": cached, "hit_rate": sum(cached) / sum(len(p) for p in prompts),
           "metrics_prefix_cache_queries": queries, "metrics_prefix_cache_hits": hits,
           "metrics_hit_rate": hits / queries if queries else None,
           "first_tokens": first, "first_logprobs": logprobs}
    del eng, pool
    gc.collect()
    if loaded.device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(loaded.device) / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(loaded.device)
    return out


def compare(off: dict, on: dict) -> dict:
    same = [a == b for a, b in zip(off["first_tokens"], on["first_tokens"])]
    diffs = []
    for i, ok in enumerate(same):
        if not ok:  # how close the off run's top two were, and the on run's
            diffs.append({"request": i, "off_top5": off["first_logprobs"][i], "on_top5": on["first_logprobs"][i]})
    d_lp = [abs(a[0][1] - b[0][1]) for a, b, ok in zip(off["first_logprobs"], on["first_logprobs"], same) if ok]
    return {"token_budget": off["token_budget"], "speedup_mean_ttft": off["mean_ttft_s"] / on["mean_ttft_s"],
            "speedup_median_ttft": off["median_ttft_s"] / on["median_ttft_s"],
            "bar_met": off["mean_ttft_s"] / on["mean_ttft_s"] >= BAR,
            "same_first_tokens": all(same), "num_same_first_tokens": sum(same), "num_requests": len(same),
            "max_abs_diff_first_token_logprob": max(d_lp) if d_lp else None, "differing": diffs}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _top2_gap(x: torch.Tensor) -> float:
    t = x.float().topk(2).values
    return float(t[0] - t[1])


@torch.inference_mode()
def fp32_check(loaded: build.LoadedModel, args, prompts, which: list[int]) -> dict:
    """For the requests ``which``: last-token logits of the off path (the whole prompt, one chunk) and
    the on path (then the tail again as a later chunk over the head's K/V in the pool, as a cache
    hit runs), both against the model in float32 with the plain reference attention (weights
    converted in place and back: bf16 -> fp32 -> bf16 is exact). Says whether a first token that
    differs on and off is a near tie that the two bf16 attention kernels round differently."""
    from concurrent.futures import Future

    from prefill_server.engine.scheduler import Chunk, Sequence
    from prefill_server.layers import fused
    from prefill_server.models.reference_attention import CausalAttention

    model, dev, n = loaded.model, loaded.device, args.head + args.tail
    cfg = EngineConfig(dtype=args.dtype, num_kv_blocks=-(-n // args.block_size) + 2, block_size=args.block_size,
                       prefix_cache=False)
    pool = build.make_pool(cfg, loaded)
    runner = build.make_runner(loaded, pool)
    got = {}
    for i in which:
        seq = Sequence(PrefillRequest(f"c{i}", tuple(prompts[i])), Future())
        seq.block_ids = pool.allocate(pool.blocks_needed(n))
        off = runner.run([Chunk(seq, 0, n)])[0].float().cpu()
        on = runner.run([Chunk(seq, args.head, n)])[0].float().cpu()
        got[i] = (off, on)
        pool.free(seq.block_ids)
    del pool, runner
    dtype = next(model.parameters()).dtype
    model.float()
    try:
        with fused.enabled(False):
            refs = {i: model(torch.tensor(prompts[i], device=dev), torch.arange(n, device=dev),
                             CausalAttention.single(n), torch.tensor([n - 1], device=dev))[0].float().cpu()
                    for i in which}
    finally:
        model.to(dtype)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rows = []
    for i in which:
        off, on = got[i]
        ref = refs[i]
        a = int(ref.argmax())
        rows.append({"request": i, "off_vs_fp32_rel": _rel(off, ref), "on_vs_fp32_rel": _rel(on, ref),
                     "on_vs_off_rel": _rel(on, off), "off_argmax": int(off.argmax()), "on_argmax": int(on.argmax()),
                     "fp32_argmax": a, "fp32_top2_gap": _top2_gap(ref), "off_top2_gap": _top2_gap(off),
                     "off_argmax_eq_fp32": int(off.argmax()) == a, "on_argmax_eq_fp32": int(on.argmax()) == a})
    return {"requests": rows,
            "mean_off_vs_fp32_rel": statistics.mean(r["off_vs_fp32_rel"] for r in rows),
            "mean_on_vs_fp32_rel": statistics.mean(r["on_vs_fp32_rel"] for r in rows),
            "off_argmax_eq_fp32": sum(r["off_argmax_eq_fp32"] for r in rows),
            "on_argmax_eq_fp32": sum(r["on_argmax_eq_fp32"] for r in rows), "num": len(rows)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b", choices=["llama-3.1-8b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--head", type=int, default=8192)
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budgets", default="16384,2048", help="token budgets, each run off then on")
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs of the first budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp32-check", type=int, default=12,
                    help="requests judged against float32 (those whose first token differs on/off in the "
                    "first pair, then the first ones; 0 = skip)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "result.json"))
    args = ap.parse_args(argv)
    budgets = [int(x) for x in args.budgets.split(",") if x.strip()]
    t_start = time.monotonic()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    smi_before = smi() if device.type == "cuda" else None
    mcfg = model_config(args.preset)
    model = random_model(mcfg, device, dtype, seed=args.seed)
    loaded = build.LoadedModel(f"random-{args.preset}-seed{args.seed}", mcfg, model, None, dtype, device)
    log(f"model ready: {time.monotonic() - t_start:.1f} s")
    rng = random.Random(args.seed)
    V = mcfg.vocab_size
    lo = min(100, V // 4)

    def toks(n):
        return [rng.randrange(lo, V) for _ in range(n)]

    head = toks(args.head)
    prompts = [head + toks(args.tail) for _ in range(args.n)]
    warm_head = toks(args.head)
    warm = [warm_head + toks(args.tail) for _ in range(2)]
    plan = [(budgets[0], r) for r in range(args.rounds)] + [(b, 0) for b in budgets[1:]]
    runs, pairs = [], []
    for budget, rnd in plan:
        off = run(loaded, args, budget, False, prompts, warm)
        on = run(loaded, args, budget, True, prompts, warm)
        off["round"] = on["round"] = rnd
        runs += [off, on]
        c = compare(off, on)
        c["round"] = rnd
        c.update(mean_off_s=off["mean_ttft_s"], mean_on_s=on["mean_ttft_s"], median_off_s=off["median_ttft_s"],
                 median_on_s=on["median_ttft_s"], hit_rate=on["hit_rate"], metrics_hit_rate=on["metrics_hit_rate"])
        pairs.append(c)
    first_all = [r["first_tokens"] for r in runs]
    check = None
    if args.fp32_check:
        differ = [d["request"] for d in pairs[0]["differing"]]
        which = (differ + [i for i in range(args.n) if i not in differ])[:max(args.fp32_check, len(differ))]
        t0 = time.monotonic()
        check = fp32_check(loaded, args, prompts, sorted(which))
        check["seconds"] = time.monotonic() - t0
        # the on path emulated here must be the one the engine ran: same first tokens as its runs
        check["emulation_matches_runs"] = all(
            r["off_argmax"] == runs[0]["first_tokens"][r["request"]]
            and r["on_argmax"] == runs[1]["first_tokens"][r["request"]] for r in check["requests"])
    out = {"workload": f"{args.n} requests, one at a time: a shared {args.head}-token head + distinct "
                       f"{args.tail}-token tails (random token ids)",
           "model": f"{args.preset} shape, random weights (seed {args.seed})", "dtype": args.dtype,
           "device": str(device), "block_size": args.block_size,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "torch": torch.__version__, "triton": _version("triton"),
           "host": platform.node(), "cpu_cores": os.cpu_count(), "command": " ".join(sys.argv),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "bar": f"mean TTFT off / on >= {BAR} (first budget)", "pairs": pairs,
           "same_first_tokens_all_runs": all(f == first_all[0] for f in first_all),
           "fp32_check": check, "smi_before": smi_before, "smi_after": smi() if device.type == "cuda" else None,
           "wall_s": time.monotonic() - t_start, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{out['workload']}; {out['model']}, {args.dtype}, {out['gpu'] or device}")
    print("budget round  mean off   mean on   ratio  median off  median on  ratio  hit rate (metrics)  "
          "same first tokens")
    for c in pairs:
        print(f"{c['token_budget']:6d} {c['round']:5d} {c['mean_off_s'] * 1e3:8.1f}ms {c['mean_on_s'] * 1e3:8.1f}ms "
              f"{c['speedup_mean_ttft']:6.2f}x {c['median_off_s'] * 1e3:9.1f}ms {c['median_on_s'] * 1e3:8.1f}ms "
              f"{c['speedup_median_ttft']:6.2f}x {c['hit_rate']:.4f} ({c['metrics_hit_rate']})  "
              f"{c['num_same_first_tokens']}/{c['num_requests']} (max |d logprob| "
              f"{c['max_abs_diff_first_token_logprob']})")
    if check:
        print(f"fp32 check of {check['num']} requests ({check['seconds']:.1f} s): logits rel err vs fp32 off "
              f"{check['mean_off_vs_fp32_rel']:.4g}, on {check['mean_on_vs_fp32_rel']:.4g}; argmax = fp32's: off "
              f"{check['off_argmax_eq_fp32']}, on {check['on_argmax_eq_fp32']}; emulation = runs: "
              f"{check['emulation_matches_runs']}")
        for r in check["requests"]:
            print(f"  r{r['request']}: off {r['off_argmax']} on {r['on_argmax']} fp32 {r['fp32_argmax']} "
                  f"(fp32 top-2 gap {r['fp32_top2_gap']:.4f}, off's {r['off_top2_gap']:.4f}); rel err off "
                  f"{r['off_vs_fp32_rel']:.4g} on {r['on_vs_fp32_rel']:.4g} on-off {r['on_vs_off_rel']:.4g}")
    met = all(c["bar_met"] for c in pairs if c["token_budget"] == budgets[0])
    print(f"same first tokens in all {len(runs)} runs: {out['same_first_tokens_all_runs']}; "
          f"bar (>= {BAR}x, budget {budgets[0]}): {'met' if met else 'NOT met'}; "
          f"wall {out['wall_s']:.1f} s; smi after {out['smi_after']}")


if __name__ == "__main__":
    main()

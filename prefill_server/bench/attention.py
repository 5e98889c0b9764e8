"""``prefill-server bench attention``: dense cuDNN SDPA vs FlexAttention vs our block-sparse kernel.

For each length: dense causal attention through cuDNN SDPA; FlexAttention (torch.compile) and our
kernel on the same fixed block masks (sink + local band + random blocks, one mask per KV head,
shared by its query heads); our estimator (``plan`` with the default config) timed on its own; and
estimator + kernel. Writes one JSON file; prints a table. Needs a CUDA GPU.

FlexAttention at its best settings (``--flex-configs``, default ``FLEX_DEFAULT``): on every
mask each configuration is checked against our kernel's output and timed, and the fastest correct one
is the one compared (each compiles once per length). The JSON keeps every configuration's time
(``flex_tuning`` rows) and which one was compared (``flex_config``).

    prefill-server bench attention --lengths 32768,131072,262144,1048576 --out bench.json
"""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import statistics
import sys

import torch

from prefill_server.kernels.block_sparse import SparseConfig, build_layout, plan, plan_from_mask
from prefill_server.kernels.block_sparse.layout import slot_geometry


def time_ms(fn, budget_ms: float = 2000.0, min_reps: int = 3, max_reps: int = 50, warmup: int = 1):
    """Median of CUDA-event timings after ``warmup`` calls; repetitions fit ``budget_ms``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    reps = max_reps
    for i in range(max_reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        if i == 0:
            reps = int(min(max_reps, max(min_reps, budget_ms / max(times[0], 1e-3))))
        if len(times) >= reps:
            break
    return statistics.median(times), times


# FlexAttention configurations tried per length (name -> torch.compile mode, kernel_options). Its
# options for Hopper: TMA loads; rows guaranteed safe (every causal row keeps its diagonal block, so no
# fully-masked row needs its guard); the scale folded into q once (PRESCALE_QK); and inductor's own
# autotuning over its block sizes, warps and stages (max-autotune).
FLEX_CONFIGS = {
    "default": (None, {}),
    "tma": (None, {"USE_TMA": True}),
    "tma_safe_prescale": (None, {"USE_TMA": True, "ROWS_GUARANTEED_SAFE": True, "PRESCALE_QK": True}),
    "autotune_tma_safe": ("max-autotune-no-cudagraphs", {"USE_TMA": True, "ROWS_GUARANTEED_SAFE": True}),
}
# Tried by default: all but inductor's autotuning, which on an H100 at 128K took 80 s, chose a
# configuration slower than "default" on our mask (5.05 vs 4.70 ms at 1%) and did not finish at 256K
# within a 10-minute call (docs/bench/2026-12-06-diag-fixed/README.md).
FLEX_DEFAULT = ["default", "tma", "tma_safe_prescale"]


def flex_callables(names: list[str]) -> dict:
    """name -> compiled ``f(q, k, v, block_mask)`` for each FlexAttention configuration."""
    from torch.nn.attention.flex_attention import flex_attention

    out = {}
    for name in names:
        mode, opts = FLEX_CONFIGS[name]

        def f(q, k, v, bm, _opts=opts):
            return flex_attention(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=dict(_opts) or None)

        out[name] = torch.compile(f, dynamic=False, mode=mode)
    return out


def tune_flex(flex: dict, qf, kf, vf, bm, ref_out, budget: float, tokens: int, density: float,
              rows: list) -> tuple[str | None, float]:
    """Time every configuration on one mask: (the fastest whose output matches ours (rel L2 < 2e-2,
    bf16 rounding of two different summation orders), its ms). One row per configuration."""
    best, best_ms = None, float("inf")
    ref = ref_out.float()
    for name, fn in flex.items():
        row = {"tokens": tokens, "impl": "flex_tuning", "density": density, "flex_config": name}
        try:
            o = fn(qf, kf, vf, bm)[0].transpose(0, 1).float()
            err = float((o - ref).norm() / ref.norm())
            ms, _ = time_ms(functools.partial(fn, qf, kf, vf, bm), budget, warmup=2)
            row.update(ms=ms, rel_l2_vs_ours=err, ok=err < 2e-2)
            if row["ok"] and ms < best_ms:
                best, best_ms = name, ms
        except Exception as e:  # noqa: BLE001 - a configuration this torch/GPU cannot build
            row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(f"flex {name}: {row.get('ms', float('nan')):.3f} ms, rel err {row.get('rel_l2_vs_ours', float('nan')):.1e}"
              + (f" ({row['error']})" if "error" in row else ""), flush=True)
    return best, best_ms


def fixed_mask(layout, hkv: int, density: float, seed: int = 0, shared_heads: bool = False):
    """Slot-space mask: sink block, one local block and the diagonal always, plus random blocks with
    the probability that brings the expected causal-block density to ``density``."""
    lo, hi, valid = slot_geometry(layout)
    dev = layout.device
    col = torch.arange(layout.max_kblocks, device=dev)
    selectable = (col[None, :] < lo[:, None]) & valid[:, None]
    forced = selectable & ((col[None, :] == 0) | (col[None, :] == lo[:, None] - 1))
    total = float(torch.where(valid, hi + 1, 0).sum())
    n_forced = float(forced.sum() + torch.where(valid, hi - lo + 1, 0).sum())
    n_free = float((selectable & ~forced).sum())
    p = min(1.0, max(0.0, (density * total - n_forced) / max(n_free, 1.0)))
    g = torch.Generator(device=dev).manual_seed(seed)
    h = 1 if shared_heads else hkv
    r = torch.rand(layout.n_slots, h, layout.max_kblocks, generator=g, device=dev) < p
    sel = (r & selectable[:, None]) | forced[:, None]
    return sel.expand(-1, hkv, -1) if shared_heads else sel


def flex_block_mask(p, hq: int, t: int, shared_heads: bool):
    """FlexAttention BlockMask equal to plan ``p`` (one sequence, q_len == k_len, t % 128 == 0):
    selected off-diagonal blocks as full blocks, the diagonal block as partial with a causal mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    nqb = t // 128
    hkv = p.idx.shape[1]
    idx, cnt = p.idx[:nqb], p.cnt[:nqb]
    if shared_heads:
        idx, cnt = idx[:, :1], cnt[:, :1]
    else:
        idx, cnt = idx.repeat_interleave(hq // hkv, 1), cnt.repeat_interleave(hq // hkv, 1)
    h = idx.shape[1]
    full_idx = idx.permute(1, 0, 2)[None].contiguous()
    full_cnt = cnt.permute(1, 0)[None].contiguous()
    part_idx = torch.zeros(1, h, nqb, idx.shape[-1], dtype=torch.int32, device=idx.device)
    part_idx[..., 0] = torch.arange(nqb, device=idx.device, dtype=torch.int32)
    part_cnt = torch.ones(1, h, nqb, dtype=torch.int32, device=idx.device)
    kw = dict(BLOCK_SIZE=128, mask_mod=causal)
    try:
        return BlockMask.from_kv_blocks(part_cnt, part_idx, full_cnt, full_idx, compute_q_blocks=False, **kw)
    except TypeError:
        return BlockMask.from_kv_blocks(part_cnt, part_idx, full_cnt, full_idx, **kw)


def _causal_flops(t: int, hq: int, d: int) -> float:
    return 4.0 * hq * d * t * (t + 1) / 2


def run(args) -> dict:
    from prefill_server.kernels.block_sparse import kernel  # noqa: F401 (Triton compiles here)
    dev = torch.device("cuda")
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cfg = SparseConfig()
    flex = None
    if not args.skip_flex:
        flex = flex_callables(args.flex_configs)
    res = {"meta": {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "prefill-server bench attention " + " ".join(args.argv),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "cuda": torch.version.cuda,
        "shape": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": args.dtype, "batch": 1,
                  "causal": True, "block": 128},
        "config": cfg.__dict__, "kernel_launch": dict(kernel.DEFAULTS)}, "results": []}
    rows = res["results"]
    g = torch.Generator(device=dev).manual_seed(0)
    for t in args.lengths:
        torch.cuda.empty_cache()
        q = torch.randn(t, hq, d, device=dev, dtype=dtype, generator=g)
        k = torch.randn(t, hkv, d, device=dev, dtype=dtype, generator=g)
        v = torch.randn(t, hkv, d, device=dev, dtype=dtype, generator=g)
        cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
        lay = build_layout(cu, cu, t, t, 128)
        flops = _causal_flops(t, hq, d)
        budget = args.budget_ms
        # dense cuDNN
        dense_ms = None
        if t <= args.max_dense_len:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # GQA without copies (same time as expanded K/V)
                f = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                             enable_gqa=True)
                dense_ms, _ = time_ms(f, budget, min_reps=1 if t > 300_000 else 3)
            del kt, vt, qt
            rows.append({"tokens": t, "impl": "dense_cudnn", "ms": dense_ms,
                         "tflops": flops / dense_ms / 1e9})
        # our kernel visiting every causal block (the dense fallback with LSE)
        # (each fn below is called inside time_ms, now; partial binds this length's q/k/v/p, which the
        # loop deletes at its end to free the memory before the next length's)
        if t <= args.max_ours_dense_len:
            sc = {}
            ours_dense, _ = time_ms(functools.partial(kernel.attention, q, k, v, lay, None, None, dense=True,
                                                      sched_cache=sc), budget)
            rows.append({"tokens": t, "impl": "ours_dense_mode", "ms": ours_dense,
                         "tflops": flops / ours_dense / 1e9,
                         "vs_cudnn": ours_dense / dense_ms if dense_ms else None})
        # estimator (the layout is per batch and reused by every layer: timed apart)
        lay_ms, _ = time_ms(lambda: build_layout(cu, cu, t, t, 128), 300)
        rows.append({"tokens": t, "impl": "layout_per_batch", "ms": lay_ms})
        est_ms, _ = time_ms(functools.partial(plan, q, k, cu, cu, cfg, layout=lay), budget)
        p_est = plan(q, k, cu, cu, cfg, layout=lay)
        rows.append({"tokens": t, "impl": "ours_estimator", "ms": est_ms,
                     "density_on_random_data": p_est.density(),
                     "frac_of_dense": est_ms / dense_ms if dense_ms else None})
        del p_est
        shared = t > args.max_per_head_mask_len
        if flex is not None and t <= args.max_flex_len:
            qf, kf, vf = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
        for dens in args.densities:
            sel = fixed_mask(lay, hkv, dens, seed=1, shared_heads=shared)
            p = plan_from_mask(sel, lay, cfg)
            real = p.density()
            del sel
            p._sel = None
            p.run(q, k, v)  # builds and caches the persistent schedule (once per plan)
            k_ms, _ = time_ms(functools.partial(p.run, q, k, v), budget)
            row = {"tokens": t, "impl": "ours_kernel", "target_density": dens, "density": real,
                   "mask_heads": "shared" if shared else "per-kv-head", "ms": k_ms,
                   "estimator_plus_kernel_ms": est_ms + k_ms}
            if dense_ms:
                row.update(ideal_ms=dense_ms * real, vs_ideal=k_ms / (dense_ms * real),
                           speedup_vs_dense=dense_ms / k_ms,
                           total_speedup_vs_dense=dense_ms / (est_ms + k_ms))
            if flex is not None and t <= args.max_flex_len:
                bm = flex_block_mask(p, hq, t, shared)
                best, f_ms = tune_flex(flex, qf, kf, vf, bm, p.run(q, k, v)[0], budget, t, real, rows)
                if best:
                    row.update(flex_ms=f_ms, speedup_vs_flex=f_ms / k_ms, flex_config=best)
                    if dense_ms:
                        rows.append({"tokens": t, "impl": "flex", "target_density": dens, "density": real,
                                     "ms": f_ms, "speedup_vs_dense": dense_ms / f_ms, "flex_config": best})
                del bm
            rows.append(row)
            del p
        del q, k, v
        if flex is not None and t <= args.max_flex_len:
            del qf, kf, vf
        if args.out:  # partial results survive a later failure
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        print(table({"results": [r for r in rows if r["tokens"] == t]}), flush=True)
    return res


def table(res: dict) -> str:
    out = ["tokens  impl              density   ms        vs dense  vs flex  vs ideal"]
    for r in res["results"]:
        if "ms" not in r:  # a FlexAttention configuration that did not build (its error is in the JSON)
            continue
        dens = r.get("density")
        out.append(f"{r['tokens']:>7}  {r['impl']:<16}  {'' if dens is None else f'{dens:.4f}':<8}  "
                   f"{r['ms']:<8.3f}  {r.get('speedup_vs_dense', float('nan')):<8.2f}  "
                   f"{r.get('speedup_vs_flex', float('nan')):<7.2f}  {r.get('vs_ideal', float('nan')):.2f}"
                   + (f"  total {r['estimator_plus_kernel_ms']:.2f} ms = {r.get('total_speedup_vs_dense', float('nan')):.1f}x"
                      if "estimator_plus_kernel_ms" in r else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="prefill-server bench attention", description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]
    floats = lambda s: [float(x) for x in s.split(",")]
    ap.add_argument("--lengths", type=ints, default=[32768, 131072, 262144, 1048576])
    ap.add_argument("--densities", type=floats, default=[0.01, 0.02, 0.05, 0.10])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--budget-ms", type=float, default=1500.0, help="time budget per measurement")
    ap.add_argument("--max-dense-len", type=int, default=1 << 21, help="skip cuDNN dense above this")
    ap.add_argument("--max-flex-len", type=int, default=1 << 21)
    ap.add_argument("--max-per-head-mask-len", type=int, default=300_000,
                    help="longer runs use one mask shared by all heads (FlexAttention's mask memory)")
    ap.add_argument("--max-ours-dense-len", type=int, default=300_000)
    ap.add_argument("--skip-flex", action="store_true")
    ap.add_argument("--flex-configs", type=lambda x: x.split(","), default=list(FLEX_DEFAULT),
                    help="FlexAttention configurations timed on every mask, comma-separated, of: "
                         + ", ".join(FLEX_CONFIGS) + f" (default: {','.join(FLEX_DEFAULT)}); "
                         "the fastest correct one is compared")
    ap.add_argument("--kernel", default="", help="launch options, e.g. mode=merged,bn=64,maxnreg=128 "
                    "(default: kernel.DEFAULTS)")
    ap.add_argument("--out", default="bench_attention.json")
    args = ap.parse_args(argv)
    args.argv = argv
    unknown = [c for c in args.flex_configs if c not in FLEX_CONFIGS]
    if unknown:
        ap.error(f"unknown --flex-configs {unknown}; choose from {list(FLEX_CONFIGS)}")
    if not torch.cuda.is_available():
        print("bench attention needs a CUDA GPU", file=sys.stderr)
        return 2
    for t in args.lengths:
        if t % 128:
            ap.error(f"lengths must be multiples of 128, got {t}")
    if args.kernel:
        from prefill_server.kernels.block_sparse import kernel
        for kv in args.kernel.split(","):
            key, val = kv.split("=")
            kernel.DEFAULTS[key] = None if val == "None" else (val if key == "mode" else int(val))
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU call: bf16 correctness of every launch variant, then variants vs cuDNN dense and FlexAttention
on the same masks, at one or more lengths, plus the estimator, all in the same run.

    PYTHONPATH=. python3 docs/bench/2026-12-01-attention-fixm/bsa_tune.py --out $OUT/tune.json --best $OUT/best.txt \
        [--tokens 131072,262144] [--finalists 3] [--no-flex]

Every variant is timed at the first length, in ``--rounds`` interleaved rounds per density (each
round times every variant once; the median over rounds is the variant's time, the spread between
rounds the noise). The first variant is the same-run baseline (the current default). "Best" = the
fastest at the lowest density among the variants no more than 1% slower than the baseline at every
other density; the ``--finalists`` best by that rule and the baseline are also timed at the later
lengths. cuDNN dense is timed at the start and the end of each length. Writes JSON (partial results
survive a failure), prints a short table last.
Variant = (mode, gp, tok, bn, num_warps, num_stages, maxnreg, ctas_per_sm, fma, kvload, rcp, fixm).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import traceback

import torch

from prefill_server.bench.attention import fixed_mask, flex_block_mask, time_ms
from prefill_server.kernels.block_sparse import SparseConfig, build_layout, plan, plan_from_mask
from prefill_server.kernels.block_sparse import estimate, kernel, reference as ref

VARIANTS = [  # (mode, gp, tok, bn, num_warps, num_stages, maxnreg, ctas_per_sm, fma, kvload, rcp, fixm)
    ("grid", 4, 32, 64, 8, 2, 128, 2, 1, 2, 1, 0),  # the default since call 8 (reciprocal epilogue)
    ("grid", 4, 32, 64, 8, 2, 128, 2, 1, 2, 1, 1),  # + fixed softmax reference (call 10)
]
# Calls 7-9 (docs/kernels-notes.md) also timed options dropped since (code in commits 1adbf54 and
# 6d804b4): item scalars in one round trip, diagonal tiles in the TMA loop, L2 prefetch of Q, BN=32
# with 3 stages, lazy rescale, row sums on the tensor cores.
KEYS = ("mode", "gp", "tok", "bn", "num_warps", "num_stages", "maxnreg", "ctas_per_sm", "fma", "kvload", "rcp",
        "fixm", "ostore")  # (a variant may leave out the last keys: the kernel's defaults then)
DENSITIES = (0.02, 0.05, 0.10)
HQ, HKV, D = 32, 8, 128
SMOKE = False  # --smoke: CPU dry run of this script (interpreter, fp16, tiny sizes, host timing)
DTYPE = torch.bfloat16


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def launch(q, k, v, lay, p, var, dense=False, out=None, lse=None):
    kw = dict(zip(KEYS, var))
    return kernel.attention(q, k, v, lay, None if dense else p.idx, None if dense else p.cnt,
                            dense=dense, out=out, lse=lse, **kw)


def rand_qkv(tq, tk, g, dev):
    q = torch.randn(tq, HQ, D, device=dev, generator=g).to(DTYPE)
    k = torch.randn(tk, HKV, D, device=dev, generator=g).to(DTYPE)
    v = torch.randn(tk, HKV, D, device=dev, generator=g).to(DTYPE)
    return q, k, v


def check_variants(rows, g, dev):
    """bf16, fresh random inputs per case, output poisoned with NaN: 32K single sequence (10% mask),
    a varlen batch with q_len < k_len (10% mask), and dense mode at 8K, each vs the reference."""
    cases = []
    sizes = ((("32k_10pct", [32768], [32768]), ("varlen_q_lt_k", [3000, 5000, 777], [3000, 9000, 4000]),
              ("dense_8k", [8192], [8192])) if not SMOKE else
             (("32k_10pct", [256], [256]), ("varlen_q_lt_k", [200, 77], [300, 500]), ("dense_8k", [256], [256])))
    for name, ql, kl in sizes:
        q, k, v = rand_qkv(sum(ql), sum(kl), g, dev)
        cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        lay = build_layout(cu(ql), cu(kl), q.shape[0], k.shape[0], 128)
        dense = name.startswith("dense")
        if dense:
            o_ref, l_ref = ref.dense_attention(q, k, v, lay)
            p = None
        else:
            sel = torch.rand(lay.n_slots, HKV, lay.max_kblocks, device=dev, generator=g) < 0.1
            p = plan_from_mask(sel, lay)
            o_ref, l_ref = ref.attention(q, k, v, lay, sel)
        cases.append((name, q, k, v, lay, p, dense, o_ref, l_ref))
    ok = []
    for var in VARIANTS:
        good = True
        for name, q, k, v, lay, p, dense, o_ref, l_ref in cases:
            try:
                out = torch.full_like(q, float("nan"))
                lse = torch.full(q.shape[:2], float("nan"), device=dev)
                o, l = launch(q, k, v, lay, p, var, dense=dense, out=out, lse=lse)
                ck = kernel.last_compiled
                r = {"check": name, "variant": var, "rel_l2": rel(o, o_ref),
                     "lse_maxerr": float((l - l_ref).abs().max()),
                     "nan": bool(o.isnan().any() or l.isnan().any()),
                     "n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None)}
                good &= r["rel_l2"] < 1e-2 and r["lse_maxerr"] < 1e-2 and not r["nan"]
            except Exception:  # noqa: BLE001
                r = {"check": name, "variant": var, "error": traceback.format_exc()[-600:]}
                good = False
            rows.append(r)
        if good:
            ok.append(var)
    return ok


def _host_time_ms(fn, budget_ms=0.0, min_reps=1, max_reps=1, warmup=0):
    import time
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    return ms, [ms]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--best", required=True, help="file to write the fastest variant's launch options")
    ap.add_argument("--tokens", default="131072")
    ap.add_argument("--finalists", type=int, default=2)
    ap.add_argument("--budget-ms", type=float, default=800.0)
    ap.add_argument("--rounds", default="3", help="interleaved timing rounds at the first length, one number or "
                    "one per density (3,2,2)")
    ap.add_argument("--variants", default="", help="indices into VARIANTS (default: all; keep 0, the baseline)")
    ap.add_argument("--extra", action="append", default=[], help="one more variant, its KEYS comma-separated "
                    "(grid,4,64,64,16,2,128,1,1,2,1,1); repeatable")
    ap.add_argument("--densities", default="", help="the fixed-mask densities, lowest first (default 0.02,0.05,0.1)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    global SMOKE, DTYPE, time_ms, VARIANTS, DENSITIES
    if args.variants:
        VARIANTS = [VARIANTS[int(i)] for i in args.variants.split(",")]
    VARIANTS = VARIANTS + [tuple(x if j == 0 else int(x) for j, x in enumerate(e.split(","))) for e in args.extra]
    if args.densities:
        DENSITIES = tuple(float(x) for x in args.densities.split(","))
    rounds = [int(x) for x in args.rounds.split(",")]
    rounds += [rounds[-1]] * (len(DENSITIES) - len(rounds))
    if args.smoke:
        SMOKE, DTYPE, args.no_flex = True, torch.float16, True
        import sys
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "kernels"))
        import conftest  # noqa: F401 (the interpreter's NumPy >= 2.4 fix)
        time_ms = _host_time_ms
    dev = torch.device("cpu" if SMOKE else "cuda")
    smi = lambda: "" if SMOKE else subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                                  "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    res = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "variants_keys": KEYS, "smi_start": smi(),
           "rows": []}
    rows = res["rows"]

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    g = torch.Generator(device=dev).manual_seed(0)
    ok_vars = check_variants(rows, g, dev)
    res["correct_variants"] = ok_vars
    save()
    if not SMOKE:
        torch.cuda.empty_cache()

    from torch.nn.attention import SDPBackend, sdpa_kernel
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    lengths = [int(x) for x in args.tokens.split(",")]
    med = {}  # (tokens, density index, variant) -> median over rounds
    base = ok_vars[0] if ok_vars and ok_vars[0] == VARIANTS[0] else None
    ranked = []

    def rank(t):
        """Variants by time at the lowest density, those > 1% slower than the baseline elsewhere last."""
        def key(var):
            worse = base is not None and any(
                med.get((t, i, var), 1e9) > 1.01 * med.get((t, i, base), 1e9) for i in range(1, len(DENSITIES)))
            return (worse, med.get((t, 0, var), 1e9))
        return sorted({var for (t_, _, var) in med if t_ == t}, key=key)

    for li, t in enumerate(lengths):
        q, k, v = rand_qkv(t, t, g, dev)
        cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
        lay = build_layout(cu, cu, t, t, 128)
        qt, kt_, vt = (x.transpose(0, 1)[None] for x in (q, k, v))

        def cudnn(name):
            with sdpa_kernel([SDPBackend.MATH if SMOKE else SDPBackend.CUDNN_ATTENTION]):
                ms, _ = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qt, kt_, vt, is_causal=True, enable_gqa=True), 1500)
            rows.append({"tokens": t, "time": name, "ms": ms})
            return ms

        dense_ms = cudnn("dense_cudnn")
        cfg = SparseConfig(backend="triton")
        est_ms, _ = time_ms(lambda: plan(q, k, cu, cu, cfg, layout=lay), 500)
        rows.append({"tokens": t, "time": "estimator", "ms": est_ms, "frac_of_dense": est_ms / dense_ms})
        if li == 0:
            vars_t = list(ok_vars)
        else:
            vars_t = list(dict.fromkeys(ranked[:args.finalists] + ([base] if base else [])))
        for di, dens in enumerate(DENSITIES):
            sel = fixed_mask(lay, HKV, dens, seed=1)
            p = plan_from_mask(sel, lay)
            real = p.density()
            del sel
            p._sel = None
            times = {var: [] for var in vars_t}
            for var in vars_t:  # compile and warm every variant before the first round
                try:
                    launch(q, k, v, lay, p, var)
                except Exception:  # noqa: BLE001
                    rows.append({"tokens": t, "time": "ours", "density": real, "variant": var,
                                 "error": traceback.format_exc()[-600:]})
                    times.pop(var)
            for r in range(rounds[di] if li == 0 else 1):
                for var in list(times):
                    ms, _ = time_ms(lambda: launch(q, k, v, lay, p, var), args.budget_ms)
                    times[var].append(ms)
                    rows.append({"tokens": t, "time": "ours", "density": real, "variant": var, "round": r,
                                 "ms": ms, "vs_ideal": ms / (dense_ms * real)})
            for var, ts in times.items():
                med[(t, di, var)] = statistics.median(ts)
            if flex is not None:
                try:
                    bm = flex_block_mask(p, HQ, t, False)
                    qf, kf, vf = (x.contiguous() for x in (qt, kt_, vt))
                    ms, _ = time_ms(lambda: flex(qf, kf, vf, block_mask=bm, enable_gqa=True), args.budget_ms,
                                    warmup=2)
                    rows.append({"tokens": t, "time": "flex", "density": real, "ms": ms,
                                 "vs_ideal": ms / (dense_ms * real)})
                    med[(t, di, "flex")] = ms
                    del qf, kf, vf, bm
                except Exception:  # noqa: BLE001
                    rows.append({"tokens": t, "time": "flex", "density": real,
                                 "error": traceback.format_exc()[-600:]})
            med[(t, di, "density")] = real
            del p
            save()
        if li == 0:
            ranked = [var for var in rank(t) if var not in ("flex", "density")]
            best = ranked[0] if ranked else VARIANTS[0]
            with open(args.best, "w") as f:
                f.write(",".join(f"{k_}={v_}" for k_, v_ in zip(KEYS, best)))
            for var in dict.fromkeys([best] + ([base] if base else [])):  # all-blocks mode vs cuDNN
                try:
                    ms, _ = time_ms(lambda: launch(q, k, v, lay, None, var, dense=True), 1000)
                    rows.append({"tokens": t, "time": "ours_dense_mode", "variant": var, "ms": ms,
                                 "vs_cudnn": ms / dense_ms})
                except Exception:  # noqa: BLE001
                    rows.append({"tokens": t, "time": "ours_dense_mode", "variant": var,
                                 "error": traceback.format_exc()[-500:]})
        dense_end = cudnn("dense_cudnn_end")
        res.setdefault("summary", {})[str(t)] = {
            "dense_cudnn_ms": [dense_ms, dense_end], "estimator_ms": est_ms,
            "density": [med.get((t, i, "density")) for i in range(len(DENSITIES))],
            "flex_ms": [med.get((t, i, "flex")) for i in range(len(DENSITIES))],
            "variants": [(list(var), [med.get((t, i, var)) for i in range(len(DENSITIES))])
                         for var in (rank(t) if li == 0 else vars_t) if var not in ("flex", "density")]}
        del q, k, v, qt, kt_, vt
        if not SMOKE:
            torch.cuda.empty_cache()
        res["smi_end"] = smi()
        save()
    print("correct variants:", len(ok_vars), "of", len(VARIANTS))
    for r in rows:
        if "check" in r and "error" not in r and r["rel_l2"] < 1e-2 and not r["nan"]:
            continue
        if r.get("time") == "ours" and "error" not in r:
            continue
        print({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in r.items()})
    for t_, sm in res.get("summary", {}).items():
        ideal = [min(sm["dense_cudnn_ms"]) * d for d in sm["density"]]
        print(f"{t_}: cuDNN {sm['dense_cudnn_ms'][0]:.1f}/{sm['dense_cudnn_ms'][1]:.1f} ms, densities",
              [round(d, 4) for d in sm["density"]], "flex", [round(x, 2) for x in sm["flex_ms"] if x])
        for var, ms in sm["variants"]:
            tag = ",".join(str(x) for x in var[3:6] + var[10:])
            print(f"  bn,warps,stages / rcp = {tag:12s} ms", [round(x, 2) if x else None for x in ms],
                  "vs ideal (min cuDNN)", [round(x / i, 3) if x else None for x, i in zip(ms, ideal)],
                  "vs flex", [round(f / x, 3) if x and f else None for x, f in zip(ms, sm["flex_ms"])])
    print("best:", open(args.best).read() if os.path.exists(args.best) else None)

if __name__ == "__main__":
    main()

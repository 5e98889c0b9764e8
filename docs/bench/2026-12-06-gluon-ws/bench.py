"""Device script: the warp-specialised Gluon kernel (``ws_attention.py``) against the shipped Triton
kernel on the same fixed masks, cuDNN dense in the same run (issue 20: 128K 1% within 1.2x ideal).

    PYTHONPATH=. python3 docs/bench/2026-12-06-gluon-ws/bench.py check --out $OUT/check.json
    PYTHONPATH=. python3 docs/bench/2026-12-06-gluon-ws/bench.py time --out $OUT/time.json \
        [--tokens 131072] [--densities 0.01,0.02,0.05] [--rounds 3] [--variants 64,4,1;128,2,1]

``check``: bf16, every variant against the float32 reference (32K at 10%, a varlen batch with
q_len < k_len, dense mode at 8K) with outputs poisoned by NaN beforehand. ``time``: per length,
cuDNN dense, then per density ``--rounds`` interleaved rounds of the shipped kernel and every
variant (median over rounds), the shipped kernel's output compared with each variant's; cuDNN again
at the end. Variant = "key=value,..." (keyword arguments of ``ws_attention.attention``; with
``triton=1``, launch options of the shipped kernel's ``kernel.attention``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ws_attention  # noqa: E402

from prefill_server.bench.attention import fixed_mask, time_ms  # noqa: E402
from prefill_server.kernels.block_sparse import build_layout, plan_from_mask  # noqa: E402
from prefill_server.kernels.block_sparse import kernel, reference as ref  # noqa: E402

HQ, HKV, D = 32, 8, 128


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def parse_variants(s):
    """"bn=128,stages=2,fixed=1;..." -> [{"bn": 128, ...}, ...] (the keyword arguments of
    ``ws_attention.attention``); the call scripts of calls 1-2 used positional fields
    "bn,stages,fixed[,nwg]", read the same way."""
    out = []
    for v in s.split(";"):
        f = v.split(",")
        if "=" in f[0]:
            d = {k: int(x) for k, x in (e.split("=") for e in f)}
        else:
            d = dict(zip(("bn", "stages", "fixed", "nwg"), (int(x) for x in f)))
        if "fixed" in d:
            d["fixed"] = bool(d["fixed"])
        out.append(d)
    return out


def run_variant(var, q, k, v, lay, idx, cnt, dense, bad):
    """A variant: ``ws_attention.attention``'s keyword arguments, or with ``triton=1`` the shipped
    kernel's launch options (``kernel.attention``)."""
    if var.get("triton"):  # the Triton kernel (not the warp-specialised default on sm_90)
        opts = {a: b for a, b in var.items() if a != "triton"}
        return kernel.attention(q, k, v, lay, idx, cnt, dense=dense, gluon=False, **opts)
    return ws_attention.attention(q, k, v, lay, idx, cnt, dense=dense, bad=bad, **var)


def smi():
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()


def rand_qkv(tq, tk, g, dev):
    q = torch.randn(tq, HQ, D, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(tk, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(tk, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    return q, k, v


def cu(ls, dev):
    return torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32, device=dev)


def check(args, variants, res):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for name, ql, kl in (("32k_10pct", [32768], [32768]), ("varlen_q_lt_k", [3000, 5000, 777], [3000, 9000, 4000]),
                         ("dense_8k", [8192], [8192])):
        q, k, v = rand_qkv(sum(ql), sum(kl), g, dev)
        lay = build_layout(cu(ql, dev), cu(kl, dev), q.shape[0], k.shape[0], 128)
        dense = name.startswith("dense")
        if dense:
            o_ref, l_ref = ref.dense_attention(q, k, v, lay)
            p = None
        else:
            sel = torch.rand(lay.n_slots, HKV, lay.max_kblocks, device=dev, generator=g) < 0.1
            p = plan_from_mask(sel, lay)
            o_ref, l_ref = ref.attention(q, k, v, lay, sel)
        o_s, l_s = kernel.attention(q, k, v, lay, None if dense else p.idx, None if dense else p.cnt, dense=dense)
        res["rows"].append({"check": name, "variant": "shipped", "rel_l2": rel(o_s, o_ref),
                            "lse_maxerr": float((l_s - l_ref).abs().max())})
        for var in variants:
            bad = torch.zeros(1, dtype=torch.int32, device=dev)
            o, lse = run_variant(var, q, k, v, lay, None if dense else p.idx, None if dense else p.cnt, dense, bad)
            torch.cuda.synchronize()
            r = {"check": name, "variant": var, "rel_l2": rel(o, o_ref), "lse_maxerr": float((lse - l_ref).abs().max()),
                 "nan": bool(o.isnan().any() or lse.isnan().any()), "bad_rows": int(bad.item())}
            r["ok"] = r["rel_l2"] < 1e-2 and r["lse_maxerr"] < 1e-2 and not r["nan"]
            res["rows"].append(r)
            print(json.dumps(r, default=str), flush=True)


def timing(args, variants, res):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for t in [int(x) for x in args.tokens.split(",")]:
        q, k, v = rand_qkv(t, t, g, dev)
        c = torch.tensor([0, t], dtype=torch.int32, device=dev)
        lay = build_layout(c, c, t, t, 128)
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms, _ = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=True, enable_gqa=True), 1500)
            return ms

        d0 = cudnn()
        res["rows"].append({"tokens": t, "time": "dense_cudnn_start", "ms": d0, "smi": smi()})
        print(t, "cudnn", round(d0, 2), smi(), flush=True)
        cases = [(f"{dens}", dens) for dens in [float(x) for x in args.densities.split(",")]]
        if args.dense:
            cases.append(("all_blocks", None))
        for label, dens in cases:
            if dens is None:
                p, real = None, 1.0
                shipped = lambda: kernel.attention(q, k, v, lay, None, None, dense=True)
            else:
                p = plan_from_mask(fixed_mask(lay, HKV, dens, seed=1), lay)
                real = p.density()
                p._sel = None
                shipped = lambda: p.run(q, k, v)
            o_s, _ = shipped()
            fns = {"shipped": shipped}
            for var in variants:
                key = ",".join(f"{a}={b}" for a, b in var.items())
                bad = torch.zeros(1, dtype=torch.int32, device=dev)
                fn = (lambda var=var, bad=bad: run_variant(
                    var, q, k, v, lay, None if p is None else p.idx, None if p is None else p.cnt, p is None, bad))
                o, _ = fn()
                torch.cuda.synchronize()
                res["rows"].append({"tokens": t, "density": label, "variant": key, "vs_shipped_rel_l2": rel(o, o_s),
                                    "bad_rows": int(bad.item())})
                fns[key] = fn
            samples = {k_: [] for k_ in fns}
            for _ in range(args.rounds):
                for k_, fn in fns.items():
                    ms, _ = time_ms(fn, args.budget_ms)
                    samples[k_].append(ms)
            for k_, xs in samples.items():
                m = statistics.median(xs)
                row = {"tokens": t, "density": label, "real_density": real, "variant": k_, "ms": m, "rounds": xs,
                       "vs_ideal": m / (d0 * real), "vs_shipped": m / statistics.median(samples["shipped"])}
                res["rows"].append(row)
                print(t, label, k_, round(m, 3), "ideal x%.3f" % row["vs_ideal"], "shipped x%.3f" % row["vs_shipped"],
                      flush=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        d1 = cudnn()
        res["rows"].append({"tokens": t, "time": "dense_cudnn_end", "ms": d1, "smi": smi()})
        print(t, "cudnn end", round(d1, 2), smi(), flush=True)
        del q, k, v, qt, kt, vt
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("check", "time"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="nwg=2,bn=128,stages=2,fixed=1,bd=128,peel=0;nwg=2,bn=128,stages=2,fixed=1,bd=128;"
                    "nwg=2,bn=128,stages=2,fixed=1,bd=64;nwg=2,bn=128,stages=2,fixed=1,bd=32")
    ap.add_argument("--tokens", default="131072")
    ap.add_argument("--densities", default="0.01,0.02,0.05")
    ap.add_argument("--dense", action="store_true", help="also every causal block (dense mode)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-ms", type=float, default=600.0)
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "argv": sys.argv, "smi_start": smi(),
           "kernel_defaults": dict(kernel.DEFAULTS), "rows": []}
    (check if args.what == "check" else timing)(args, variants, res)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""What the warp-specialised kernel's fixed reference costs when it falls back (issue 20).

One-off GPU script (sm_90). The cases, the float32 reference over the kept blocks, the derived
fallback share and the checks are those of ``docs/bench/2026-12-04-fixm-fallback/bench.py`` (imported
from there): Llama-3.1-8B attention shape, bf16, 128K tokens, fixed masks, random data and synthetic
outliers (key 0 given a logit ~100 log2 units above the chosen rows' diagonal max, past the bf16
limit of 64). Variants, each checked against the reference (output poisoned first), then timed
interleaved (CUDA events, median):

- ``shipped``: ``kernel.attention`` with no option (the Gluon kernel, then ``redo_flagged`` over the
  items it flagged, in the same stream);
- ``ws_only``: the Gluon kernel alone (its flags counted, nothing redone: wrong where it flagged);
- ``triton``: the Triton kernel at its defaults (``gluon=False``: its own fixed reference and redo);
- ``online``: the Triton kernel with ``fixm=0`` (online softmax: no fallback to pay).

    python3 docs/bench/2026-12-08-ws-fallback/bench.py --out DIR
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import math
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
_spec = importlib.util.spec_from_file_location("fixm_fallback", HERE.parent / "2026-12-04-fixm-fallback" / "bench.py")
ff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ff)

BS = 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".devout")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--densities", default="0.01,0.02")
    ap.add_argument("--reps", type=int, default=9)
    floats = lambda x: [float(y) for y in x.split(",")]  # noqa: E731
    ap.add_argument("--scattered", type=floats, default=[0.001, 0.01, 1.0], help="row shares, scattered")
    ap.add_argument("--clustered", type=floats, default=[0.01, 0.1], help="program shares, clustered")
    args = ap.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False

    from prefill_server.bench.attention import fixed_mask
    from prefill_server.kernels.block_sparse import SparseConfig, build_layout, kernel, plan_from_mask
    from prefill_server.kernels.block_sparse import ws_kernel as ws

    dev = torch.device("cuda")
    res = {"meta": {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "command": "python3 docs/bench/2026-12-08-ws-fallback/bench.py " + " ".join(sys.argv[1:]),
                    "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": __import__("triton").__version__, "kernel_defaults": dict(kernel.DEFAULTS),
                    "reps": args.reps, "timing": "CUDA events, 2 warm-up calls each, variants interleaved, median"},
           "cases": []}

    def dump():
        (out_dir / "result.json").write_text(json.dumps(res, indent=1))

    t, hq, hkv, d = args.tokens, 32, 8, 128
    g = hq // hkv
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    lay = build_layout(cu, cu, t, t, BS)
    assert kernel._gluon_applies(q, k, v, q, lay), "the warp-specialised kernel does not apply on this device"
    nqb, split, gp, tok = t // BS, BS // ws.TOK, ws.GP, ws.TOK
    A = 32.0
    qo, ko = q.clone(), k.clone()
    qo[..., 0] = 0
    ko[..., 0] = 0
    ko[0, :, 0] = A
    lim = kernel.FIXM_LIMIT[torch.bfloat16]
    rows_ok = (torch.arange(t, device=dev) >= BS)[:, None].expand(t, hq)
    rng = torch.Generator(device=dev).manual_seed(2)

    def scattered(f):
        return rows_ok.clone() if f >= 1.0 else (torch.rand(t, hq, device=dev, generator=rng) < f) & rows_ok

    def clustered(f):  # whole items (tok tokens x gp heads) of the kernel
        pr = torch.rand(nqb, split, hkv, g // gp, device=dev, generator=rng) < f
        pr[0] = False
        return pr[:, :, None, :, :, None].expand(nqb, split, tok, hkv, g // gp, gp).reshape(t, hq).clone()

    pct = lambda f: f"{f * 100:g}%"  # noqa: E731
    cases = [("random (benchmark data)", None, None),
             ("sub-limit margin, 100% rows", lambda: rows_ok.clone(), 13.0)]
    cases += [(f"scattered {pct(f)} rows", (lambda f=f: scattered(f)), 24.0) for f in args.scattered]
    cases += [(f"clustered {pct(f)} items", (lambda f=f: clustered(f)), 24.0) for f in args.clustered]
    cases += [("overflow (p > 2**128), scattered 10% rows", lambda: scattered(0.10), 48.0)]
    out_buf = torch.empty_like(q)
    lse_buf = torch.empty(t, hq, dtype=torch.float32, device=dev)
    scale = 1.0 / math.sqrt(d)
    for dens in [float(x) for x in args.densities.split(",")]:
        sel = fixed_mask(lay, hkv, dens, seed=1)
        p = plan_from_mask(sel, lay, SparseConfig())
        cnt2 = p.cnt.view(p.cnt.shape[0], -1)
        for name, rows_fn, B in cases:
            t0 = time.time()
            if rows_fn is None:
                qq, kk = q, k
            else:
                qo[..., 0] = 0
                qo[..., 0][rows_fn()] = B
                qq, kk = qo, ko
            ro, rl, rm = ff.reference(qq, kk, v, sel)
            fb = ff.fallback_counts(rl, rm, lim, p.cnt, gp, tok)
            flags = [None]

            def ws_only():
                flags[0] = ws.attention(qq, kk, v, lay, p.idx, cnt2, scale * ff.LOG2E, lim, out_buf, lse_buf)

            variants = {
                "shipped": lambda: kernel.attention(qq, kk, v, lay, p.idx, p.cnt, out=out_buf, lse=lse_buf),
                "ws_only": ws_only,
                "triton": lambda: kernel.attention(qq, kk, v, lay, p.idx, p.cnt, gluon=False, out=out_buf, lse=lse_buf),
                "online": lambda: kernel.attention(qq, kk, v, lay, p.idx, p.cnt, fixm=0, out=out_buf, lse=lse_buf),
            }
            checks = {}
            for vn, fn in variants.items():
                out_buf.fill_(float("nan"))
                lse_buf.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                checks[vn] = ff.compare(out_buf, lse_buf, ro, rl)
            n_flagged = int((flags[0] != 0).sum())
            tm = ff.time_interleaved(variants, args.reps)
            ms = {n: m for n, (m, _) in tm.items()}
            row = {"tokens": t, "target_density": dens, "density": p.density(), "case": name, "B": B,
                   "fallback_derived": fb, "items_flagged_by_kernel": n_flagged, "items": flags[0].numel(),
                   "check": checks, "ms": ms, "ms_all": {n: v_ for n, (_, v_) in tm.items()},
                   "shipped_over_online": ms["shipped"] / ms["online"], "shipped_over_triton": ms["shipped"] / ms["triton"]}
            res["cases"].append(row)
            dump()
            print(f"{t} {dens:.2f} {name:<42} " + " ".join(f"{n} {m:7.3f}" for n, m in ms.items())
                  + f" | shipped/online {row['shipped_over_online']:.3f} shipped/triton {row['shipped_over_triton']:.3f}"
                  f" | items flagged {n_flagged}/{row['items']} derived {fb['programs_fallback']}"
                  f" | ok {[c['ok'] for vn, c in checks.items() if vn != 'ws_only']} ({time.time() - t0:.1f} s)",
                  flush=True)
            del ro, rl, rm
    dump()
    ok = all(c["ok"] for r in res["cases"] for vn, c in r["check"].items() if vn != "ws_only")
    agree = all(r["items_flagged_by_kernel"] == r["fallback_derived"]["programs_fallback"] for r in res["cases"])
    print(f"all checks ok: {ok}; kernel's flags == derived fallback items in every case: {agree}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

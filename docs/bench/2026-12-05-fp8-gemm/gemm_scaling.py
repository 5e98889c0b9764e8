"""FP8 GEMM scaling modes on one Hopper GPU (issue 20), one-off device script: is cuBLAS's tensorwise
FP8 GEMM faster than the rowwise one the engine uses, at the row counts the engine runs (chunks of
8K-32K rows), timed at the clocks a long forward holds (sustained, interleaved rounds)?

Per projection of the Llama-3.1-8B shape and row count:
  bf16        F.linear
  rowwise     torch._scaled_mm, per-token x scales [R, 1], per-channel w scales [1, N], fast accum
              (Fp8Linear today)
  tensorwise  torch._scaled_mm with scalar scales of 1.0 on the same codes, fast accum: the raw
              code products; the row and column scales would then be applied by the op that reads
              the output (residual add, SiLU-and-multiply, rope)
  tensorwise_then_scale  the same + y * x_scale * w_scale as torch ops (the unfused cost)
Each output is checked against exact float32 sums of the same codes.

    python3 docs/bench/2026-12-05-fp8-gemm/gemm_scaling.py --out $OUT/gemm.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672), "down_proj": (14336, 4096)}
FP8 = torch.float8_e4m3fn


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (x.float().abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x.float() / s).clamp(-448, 448).to(FP8), s


def timed(fn, seconds: float) -> float:
    """Median ms of one call, calls repeated for ``seconds`` (events around each batch of 10)."""
    fn()
    torch.cuda.synchronize()
    out, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 10)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8192,16384,32768")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.4)
    ap.add_argument("--heat", type=float, default=4.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    one = torch.ones((), device=dev)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda, "rows": {}}
    for m in [int(r) for r in a.rows.split(",")]:
        variants = {}
        for name, (k, n) in SHAPES.items():
            w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            wq, ws = quant_rows(w)
            xq, xs = quant_rows(x)
            ws_row = ws.reshape(1, -1).contiguous()
            wt = wq.t()
            fns = {
                "bf16": lambda x=x, w=w: F.linear(x, w),
                "rowwise": lambda xq=xq, wt=wt, xs=xs, ws_row=ws_row: torch._scaled_mm(
                    xq, wt, scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16, use_fast_accum=True),
                "tensorwise": lambda xq=xq, wt=wt: torch._scaled_mm(
                    xq, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True),
                "tensorwise_then_scale": lambda xq=xq, wt=wt, xs=xs, ws_row=ws_row: torch._scaled_mm(
                    xq, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True).mul_(xs).mul_(ws_row),
            }
            exact = (xq.float() * xs) @ (wq.float() * ws).t()
            errs = {}
            for v in ("rowwise", "tensorwise_then_scale"):
                y = fns[v]().float()
                errs[v] = ((y - exact).norm() / exact.norm()).item()
            raw = fns["tensorwise"]().float()
            errs["tensorwise_raw_max_abs"] = raw.abs().max().item()
            del exact, raw
            variants[name] = {"fns": fns, "flops": 2 * m * k * n, "err_vs_exact_sums": errs}
        # heat the card on the whole set, then interleaved rounds
        t_end = time.perf_counter() + a.heat
        while time.perf_counter() < t_end:
            for v in variants.values():
                for f in v["fns"].values():
                    f()
        torch.cuda.synchronize()
        times = {name: {v: [] for v in d["fns"]} for name, d in variants.items()}
        for _ in range(a.rounds):
            for name, d in variants.items():
                for v, f in d["fns"].items():
                    times[name][v].append(timed(f, a.seconds))
        per = {}
        for name, d in variants.items():
            ms = {v: statistics.median(t) for v, t in times[name].items()}
            per[name] = {"ms": ms, "spread": {v: [min(t), max(t)] for v, t in times[name].items()},
                         "tflops": {v: d["flops"] / t / 1e9 for v, t in ms.items()},
                         "err_vs_exact_sums": d["err_vs_exact_sums"]}
            print(m, name, {v: round(t, 3) for v, t in ms.items()},
                  "tensorwise/rowwise x%.3f" % (ms["rowwise"] / ms["tensorwise"]),
                  "rowwise/bf16 x%.3f" % (ms["bf16"] / ms["rowwise"]),
                  "tensorwise/bf16 x%.3f" % (ms["bf16"] / ms["tensorwise"]), flush=True)
        layer = {v: sum(p["ms"][v] for p in per.values()) for v in ("bf16", "rowwise", "tensorwise", "tensorwise_then_scale")}
        res["rows"][str(m)] = {"gemms": per, "layer_ms": layer}
        print(m, "layer", {v: round(t, 3) for v, t in layer.items()}, "vs bf16",
              {v: round(layer["bf16"] / t, 3) for v, t in layer.items()}, flush=True)
        del variants
        torch.cuda.empty_cache()
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()

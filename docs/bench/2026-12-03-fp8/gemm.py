"""FP8 vs bf16 GEMMs on the H200, the Llama-3.1-8B projections (issue 20), one-off device script.

Per projection and row count: bf16 ``F.linear``; ``Fp8Linear`` as the model runs it (the Triton
per-token quantization + ``torch._scaled_mm`` rowwise); the two parts alone; ``_scaled_mm`` with
use_fast_accum. Also the layer's four GEMMs back to back (a whole layer's linear work) at the
throughput run's 64K-token step. Run from the repo root on the GPU machine:

    python3 docs/bench/2026-12-03-fp8/gemm.py --out $OUT/gemm.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from prefill_server.bench.common import time_ms
from prefill_server.layers import fp8
from prefill_server.layers.linear import Linear

SHAPES = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672), "down_proj": (14336, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8192,65536")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    layers = {}
    for name, (k, n) in SHAPES.items():
        lin = Linear(k, n, bias=False).to(dev, torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02, generator=g)
        layers[name] = (lin, fp8.Fp8Linear.from_linear(lin))
    for m in [int(r) for r in a.rows.split(",")]:
        per = {}
        for name, (lin, f) in layers.items():
            k, n = SHAPES[name]
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            xq, xs = fp8.quantize_rows(x)
            flops = 2 * m * k * n
            t = {"bf16": time_ms(lambda: F.linear(x, lin.weight), dev, a.reps)[0],
                 "fp8": time_ms(lambda: f(x), dev, a.reps)[0],
                 "quant": time_ms(lambda: fp8.quantize_rows(x), dev, a.reps)[0],
                 "scaled_mm": time_ms(lambda: torch._scaled_mm(xq, f.weight.t(), scale_a=xs, scale_b=f.weight_scale,
                                                               out_dtype=torch.bfloat16), dev, a.reps)[0],
                 "scaled_mm_fast_accum": time_ms(lambda: torch._scaled_mm(
                     xq, f.weight.t(), scale_a=xs, scale_b=f.weight_scale, out_dtype=torch.bfloat16,
                     use_fast_accum=True), dev, a.reps)[0]}
            ref = F.linear(x, lin.weight).float()
            got = f(x).float()
            emu = (xq.float() * xs) @ f.dequantized().t()  # exact float32 sums of the same FP8 operands
            fast = torch._scaled_mm(xq, f.weight.t(), scale_a=xs, scale_b=f.weight_scale, out_dtype=torch.bfloat16,
                                    use_fast_accum=True).float()

            def rel(a_, b_):
                return ((a_ - b_).norm() / b_.norm()).item()
            per[name] = {"ms": t, "tflops": {v: flops / ms / 1e9 for v, ms in t.items() if v != "quant"},
                         "speedup_fp8_over_bf16": t["bf16"] / t["fp8"],
                         "speedup_fast_accum_over_bf16": t["bf16"] / (t["quant"] + t["scaled_mm_fast_accum"]),
                         "rel_err_vs_bf16": rel(got, ref), "rel_err_fast_accum_vs_bf16": rel(fast, ref),
                         "rel_err_vs_exact_sums": rel(got, emu), "rel_err_fast_accum_vs_exact_sums": rel(fast, emu),
                         "max_abs_err_vs_exact_sums": (got - emu).abs().max().item(),
                         "max_abs_err_fast_accum_vs_exact_sums": (fast - emu).abs().max().item()}
            del emu, fast
            print(m, name, {v: round(ms, 3) for v, ms in t.items()}, f"x{t['bf16'] / t['fp8']:.2f}",
                  f"err {per[name]['rel_err_vs_bf16']:.4f}", "vs exact sums", f"{per[name]['rel_err_vs_exact_sums']:.2e}",
                  f"fast accum {per[name]['rel_err_fast_accum_vs_exact_sums']:.2e}", flush=True)
            del x, xq, xs, ref, got
        tot = {v: sum(p["ms"][v] for p in per.values()) for v in ("bf16", "fp8", "quant", "scaled_mm")}
        res["rows"][str(m)] = {"gemms": per, "layer_ms": tot, "layer_speedup": tot["bf16"] / tot["fp8"]}
        print(m, "layer", {v: round(ms, 3) for v, ms in tot.items()}, f"x{tot['bf16'] / tot['fp8']:.2f}", flush=True)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())

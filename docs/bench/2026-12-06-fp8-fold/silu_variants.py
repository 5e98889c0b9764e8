"""SiLU-and-multiply with FP8 output (fp8.silu_mul_quant_kernel) on one GPU, one-off device script:
the two-pass kernel (amax, then codes) at several block sizes against the one-pass kernel that keeps the
row in registers (silu_mul_quant_row_kernel), on the 8B shape's gate_up output of one 8K-row chunk ([8192, 2 x 14336] bf16).
Codes and scales must equal the two-pass kernel's bit for bit. Prints ms
and the bytes moved per second.

    PYTHONPATH=. python3 docs/bench/2026-12-06-fp8-fold/silu_variants.py --out $OUT/silu.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from prefill_server.bench.attention import time_ms
from prefill_server.layers import fp8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    t, n = a.rows, a.inter
    gu = (torch.randn(t, 2 * n, device=dev, generator=g) * 3).to(torch.bfloat16)
    consts = (fp8.FP8_MAX, fp8.INV_FP8_MAX, fp8.MIN_SCALE)
    bytes_moved = gu.numel() * 2 + t * n + 4 * t

    def two_pass(block, warps):
        def f(q, s):
            fp8.silu_mul_quant_kernel[(t,)](gu, q, s, gu.stride(0), q.stride(0), n, *consts, BLOCK=block,
                                            num_warps=warps)
        return f

    def one_pass(warps):
        def f(q, s):
            fp8.silu_mul_quant_row_kernel[(t,)](gu, q, s, gu.stride(0), q.stride(0), n, *consts,
                                  BLOCK=triton.next_power_of_2(n), num_warps=warps)
        return f

    variants = {"two_pass_2048_w8": two_pass(2048, 8), "two_pass_4096_w8": two_pass(4096, 8),
                "two_pass_4096_w16": two_pass(4096, 16), "two_pass_1024_w4": two_pass(1024, 4),
                "one_pass_w16": one_pass(16), "one_pass_w32": one_pass(32), "one_pass_w8": one_pass(8)}
    q0, s0 = torch.empty(t, n, dtype=fp8.FP8, device=dev), torch.empty(t, 1, device=dev)
    variants["two_pass_2048_w8"](q0, s0)
    res = {"device": torch.cuda.get_device_name(), "rows": t, "inter": n, "variants": {}}
    for _ in range(2):  # two rounds: the second at the clocks the first left
        for name, f in variants.items():
            q, s = torch.empty_like(q0), torch.empty_like(s0)
            try:
                f(q, s)
                same = bool(torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0))
                ms, _ = time_ms(lambda: f(q, s), budget_ms=600)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                res["variants"][name] = {"error": repr(e)[:300]}
                continue
            res["variants"][name] = {"ms": ms, "tb_per_s": bytes_moved / ms / 1e9, "equal_to_two_pass": same}
    for name, r in res["variants"].items():
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()

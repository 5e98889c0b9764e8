"""FP8 scores in our attention kernel (issue 20's lever after the FP8 GEMMs: bf16 attention is 27% of
an FP8 step), one-off device script. On the 8B shape (32 query heads, 8 KV heads, head dim 128), for
8 x 8K (one throughput step), 32K and 128K, causal, dense:
    cudnn      the engine's path today: layers.attention.dense_attention per sequence (cuDNN SDPA, bf16)
    ours_bf16  kernel.attention(dense=True), one varlen launch, bf16
    ours_qk8   the same with q and k as e4m3 codes (per-tensor scales), p @ v in bf16
    quant_qk   quantize_e4m3 of q and k alone (an upper bound: fused into RoPE it would be ~free)
Accuracy against float32 attention (the first sequence / the first 8K queries of the long ones),
relative L2 of the output, on normal data and with outlier key channels (8 channels x 8, as real K
activations have). Interleaved rounds; medians.

    PYTHONPATH=. python3 docs/bench/2026-12-06-fp8-attention/scores.py --out $OUT/scores.json
    TRITON_INTERPRET=1 .venv/bin/python docs/bench/2026-12-06-fp8-attention/scores.py --smoke --out smoke.json

--smoke: on the CPU in Triton's interpreter, float16 for bf16, 2 x 256 tokens, errors only (no timing).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch
import torch.nn.functional as F

from prefill_server.bench.attention import time_ms
from prefill_server.kernels.block_sparse import kernel
from prefill_server.kernels.block_sparse.layout import build_layout
from prefill_server.layers.attention import dense_attention

HQ, HKV, D = 32, 8, 128
DEV, DTYPE, SMOKE = torch.device("cuda"), torch.bfloat16, False


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def reference(q, k, v, n_q: int, scale: float) -> torch.Tensor:
    """float32 causal attention of the first n_q queries of one sequence (q_len == k_len)."""
    qh = q[:n_q].float().transpose(0, 1)[None]
    kh, vh = (x[:n_q].float().transpose(0, 1)[None] for x in (k, v))
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def case(lens: list[int], rounds: int, outliers: bool) -> dict:
    dev = DEV
    g = torch.Generator(device=dev).manual_seed(0)
    t = sum(lens)
    q = torch.randn(t, HQ, D, device=dev, generator=g, dtype=DTYPE)
    k = torch.randn(t, HKV, D, device=dev, generator=g, dtype=DTYPE)
    v = torch.randn(t, HKV, D, device=dev, generator=g, dtype=DTYPE)
    if outliers:
        k[:, :, :8] *= 8
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=dev)
    layout = build_layout(cu, cu, t, t, 128)
    scale = 1.0 / math.sqrt(D)
    q8, sq = kernel.quantize_e4m3(q)
    k8, sk = kernel.quantize_e4m3(k)
    out = torch.empty_like(q)

    def cudnn():
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            out[a:b] = dense_attention(q[a:b], k[a:b], v[a:b], scale)
        return out

    fns = {"cudnn": cudnn,
           "ours_bf16": lambda: kernel.attention(q, k, v, layout, None, None, scale, dense=True)[0],
           "ours_qk8": lambda: kernel.attention(q8, k8, v, layout, None, None, scale, dense=True,
                                                qk_descale=sq * sk)[0],
           "quant_qk": lambda: (kernel.quantize_e4m3(q), kernel.quantize_e4m3(k))}
    n_ref = min(lens[0], 8192)
    ref = reference(q, k, v, n_ref, scale)
    acc = {name: rel_l2(fns[name]()[:n_ref], ref) for name in ("cudnn", "ours_bf16", "ours_qk8")}
    if SMOKE:
        return {"lens": lens, "outlier_k_channels": outliers, "dtype": str(DTYPE), "rel_l2_vs_fp32": acc}
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            times[name].append(time_ms(f, budget_ms=1500)[0])
    med = {n: sorted(x)[len(x) // 2] for n, x in times.items()}
    return {"lens": lens, "outlier_k_channels": outliers, "ms": med, "ms_rounds": times, "rel_l2_vs_fp32": acc,
            "qk8_vs_cudnn": med["cudnn"] / med["ours_qk8"], "ours_bf16_vs_cudnn": med["cudnn"] / med["ours_bf16"],
            "qk8_with_quant_vs_cudnn": med["cudnn"] / (med["ours_qk8"] + med["quant_qk"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    global DEV, DTYPE, SMOKE
    cases = (([8192] * 8, False), ([8192] * 8, True), ([32768], False), ([131072], False))
    if a.smoke:
        DEV, DTYPE, SMOKE = torch.device("cpu"), torch.float16, True
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests" / "kernels"))
        import conftest  # noqa: F401 (the interpreter's NumPy >= 2.4 fix)
        cases = (([256] * 2, False), ([256] * 2, True))
    res = []
    for lens, outl in cases:
        r = case(lens, a.rounds, outl)
        res.append(r)
        speed = "" if SMOKE else (
            f"ms {({k: round(x, 2) for k, x in r['ms'].items()})} qk8 {r['qk8_vs_cudnn']:.3f}x cudnn (with quant "
            f"{r['qk8_with_quant_vs_cudnn']:.3f}x), ours bf16 {r['ours_bf16_vs_cudnn']:.3f}x; ")
        print(f"{len(lens)}x{lens[0]} outliers={outl}: {speed}rel L2 vs fp32 "
              f"{({k: f'{x:.2e}' for k, x in r['rel_l2_vs_fp32'].items()})}", flush=True)
        with open(a.out, "w") as f:
            json.dump({"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), "cases": res}, f, indent=1)


if __name__ == "__main__":
    main()

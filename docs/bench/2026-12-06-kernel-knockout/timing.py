"""How much of the bench's timed span (``time_ms``: event, call, event, then a sync, per repetition) is
the kernel's GPU time, at 128K and 1% (the shipped launch, ``Plan.run``), beside cuDNN dense:
- ``span``: ``time_ms`` as the bench times it (the GPU idles while the host issues the call);
- ``sleep_ahead``: the same, with a ~1 ms GPU sleep queued before the first event, so the host's
  issuing overlaps it and the events bracket the GPU work only;
- ``graph``: the call captured in a CUDA graph and replayed under ``time_ms`` (no host work);
- ``queued``: n calls back to back between two events (per call);
- the host's time per call, profiled (cProfile, the top functions).

    python3 docs/bench/2026-12-06-kernel-knockout/timing.py --out $OUT/timing.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from prefill_server.bench.attention import fixed_mask, time_ms
from prefill_server.kernels.block_sparse import build_layout, plan_from_mask

HQ, HKV, D = 32, 8, 128


def sleep_ahead_ms(fn, reps: int, cycles: int = 2_000_000) -> tuple[float, list[float]]:
    fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # the GPU is busy while the host issues what follows
        a.record()
        fn()
        b.record()
        b.synchronize()
        xs.append(a.elapsed_time(b))
    return statistics.median(xs), xs


def queued_ms(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def host_profile(fn, n: int = 200) -> tuple[float, str]:
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for i in range(n):
        fn()
        if i % 10 == 9:
            torch.cuda.synchronize()  # (keep the launch queue from filling)
    pr.disable()
    wall = (time.perf_counter() - t0) / n
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
    return wall * 1e6, out.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--density", type=float, default=0.01)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    t = args.tokens
    q = torch.randn(t, HQ, D, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(t, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(t, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    c = torch.tensor([0, t], dtype=torch.int32, device=dev)
    lay = build_layout(c, c, t, t, 128)
    p = plan_from_mask(fixed_mask(lay, HKV, args.density, seed=1), lay)
    real = p.density()
    p._sel = None
    ours = lambda: p.run(q, k, v)  # noqa: E731
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    res = {"device": torch.cuda.get_device_name(), "real_density": real, "rows": []}
    d_span = time_ms(cudnn, 2500)[0]
    d_sleep = sleep_ahead_ms(cudnn, 8)[0]
    res["cudnn"] = {"span_ms": d_span, "sleep_ahead_ms": d_sleep}
    print("cudnn span", round(d_span, 3), "sleep-ahead", round(d_sleep, 3), flush=True)
    replay = graph_of(ours)
    for rnd in range(3):
        row = {"round": rnd, "span_ms": time_ms(ours, 400)[0], "sleep_ahead_ms": sleep_ahead_ms(ours, 40)[0],
               "graph_ms": time_ms(replay, 400)[0], "queued_ms": queued_ms(ours)}
        row.update({f"{k2}_vs_ideal": v2 / (d_span * real) for k2, v2 in list(row.items()) if k2.endswith("_ms")})
        res["rows"].append(row)
        print(row, flush=True)
    us, prof = host_profile(ours)
    res["host_us_per_call"] = us
    res["host_profile"] = prof
    print("host us per call", round(us, 1))
    print(prof[:3000])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Benchmark smoke tests for the GPU machine (marker ``gpu``: skipped on the CPU and not in the default
run). They run the benchmark commands (attention, e2e, stream) on the Llama-3.1-8B shape and fail when a
number regresses past a recorded guard, printing what they measured:

    python3 -m pytest -q -m gpu tests/bench/test_gpu_bench_smoke.py -s     # ~7 minutes on one H100 / H200
    scripts/gpu/regression.sh      # the same, then the stream bench (the device call after CPU-side changes)

Guards: the issue's bars where the measurement has a margin over them: the dense TTFT and the
64 x 8K throughput against the sustained floor (issue 20: 1.08x / 1.10x), the kernel against
cuDNN, FlexAttention and "ideal" (issue 5), FP8's 64 x 8K throughput over bf16 (issue 20: 1.6x), the
FP8 TTFT of 128K and 1M at a fixed 2% mask with every layer's KV streamed over NIXL to a receiver
process (issue 20: 2.5 s / 25 s; needs the NIXL wheels of scripts/gpu/lib.sh, skipped without them).
The burst floor's ratios are printed only: they move with the card's clocks while the engine's TTFT
does not.
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch

from prefill_server.bench import attention, e2e

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _by_impl(results: list[dict], tokens: int) -> dict[str, dict]:
    return {r["impl"]: r for r in results if r["tokens"] == tokens}


def test_attention_bench_128k(tmp_path):
    """Kernel, estimator and all-blocks mode against cuDNN and FlexAttention (the fastest of its
    configurations on this mask) in the same run, 128K at fixed 1% and 5% masks. Recorded at 5% (H100,
    docs/bench/2026-12-06-diag-fixed/h100-call3): 1.31x Flex at its best settings, 1.10x ideal,
    estimator + kernel 16.4x dense, estimator 0.58% of dense, all blocks 0.98x cuDNN (H200 calls 11-12,
    Flex at its defaults: 1.35x, 1.07-1.11x, 16.5-17.0x, 0.51%, 0.97-1.00x). At 1% (issue 20: within
    1.2x ideal on the H200), the warp-specialised kernel on sm_90: 1.19x and 1.26x on an H100
    (docs/bench/2026-12-07-gluon-pipe/h100-call2, h100-call3), where the Triton kernel was 1.36-1.44x."""
    out = tmp_path / "attention.json"
    assert attention.main(["--lengths", "131072", "--densities", "0.01,0.05", "--budget-ms", "600",
                           "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    by = _by_impl(res, 131072)
    kern = {round(r["density"], 2): r for r in res if r["impl"] == "ours_kernel"}
    ours, one, est, dense_mode = kern[0.05], kern[0.01], by["ours_estimator"], by["ours_dense_mode"]
    print(f"\n128K 5%: {ours['ms']:.2f} ms, {ours['speedup_vs_flex']:.2f}x Flex, {ours['vs_ideal']:.3f}x ideal, "
          f"total {ours['total_speedup_vs_dense']:.1f}x dense; estimator {est['frac_of_dense']:.2%} of dense; "
          f"all blocks {dense_mode['vs_cudnn']:.3f}x cuDNN; 1%: {one['ms']:.3f} ms, {one['vs_ideal']:.3f}x ideal, "
          f"{one['speedup_vs_flex']:.2f}x Flex")
    assert ours["speedup_vs_flex"] >= 1.2  # bar
    assert ours["vs_ideal"] <= 1.25  # bar
    assert ours["total_speedup_vs_dense"] >= 15  # bar
    assert est["frac_of_dense"] <= 0.01  # bar
    assert dense_mode["vs_cudnn"] <= 1.1  # guard (0.97-1.00 recorded; 1.11-1.14 before fixm)
    # bar on the issue's card (H200); the H100 (1.19 and 1.26 recorded) gets a guard with the runs' spread
    assert one["vs_ideal"] <= (1.2 if "H200" in torch.cuda.get_device_name() else 1.3)


def test_e2e_bench_against_sustained_floors(tmp_path):
    """The engine on random Llama-3.1-8B weights: the engine-vs-reference check, then the issue's bars
    against the sustained floor (the same GEMMs and cuDNN attention run back to back, timed after 3 s
    of that work, so both sides run at the clocks the card holds at its 700 W cap): dense TTFT at
    8K / 32K / 128K within 1.08x, 64 x 8K throughput within 1.10x of its step floor. Recorded
    (docs/bench/2026-12-03-sustained-floor/call2): 1.043 / 1.037 / 1.019 and 1.059, SM ~1,480-1,520 MHz.
    The burst floor (each op alone, at ~1,970 MHz) is printed, not guarded: it moves with the card."""
    out = tmp_path / "e2e.json"
    assert e2e.main(["--lengths", "8192,32768,131072", "--reps", "3", "--check-len", "4096",
                     "--sustained-floor", "8192,32768,131072", "--throughput", "64x8192",
                     "--token-budget", "65536", "--throughput-floor", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["check"]["pass"] and res["check"]["argmax_equal"]
    burst = {r["tokens"]: round(r["ratio"], 3) for r in res["ttft"]}
    sustained = {r["tokens"]: round(r["ratio_vs_sustained_floor"], 3) for r in res["ttft"]}
    tp = res["throughput"]["ratio_vs_sustained_floor"]
    clocks = {k: v.get("sm_mhz_mean") for k, v in res.get("clocks", {}).items() if isinstance(v, dict)}
    print(f"\nTTFT / sustained floor: {sustained}; 64 x 8K / its sustained floor: {tp:.3f}; "
          f"TTFT / burst floor: {burst}; SM MHz by phase: {clocks}")
    assert all(r <= 1.08 for r in sustained.values()), sustained  # bar
    assert tp <= 1.10  # bar


def test_fp8_64x8k_throughput_over_bf16(tmp_path):
    """Issue 20's FP8 bar: 64 x 8K with --quantization fp8 and --kv-cache-dtype fp8 (FP8 scores,
    the default there) at least 1.6x bf16's throughput, both timed in this run. Recorded
    (docs/bench/2026-12-06-fp8-attention/h100-engine, H100): 8.43 vs 13.73 s = 1.628x; FP8 linear
    layers with bf16 pages 1.512x; H200 (docs/bench/2026-12-07-h200-confirm): 8.25 vs 13.72 s = 1.664x."""
    walls = {}
    for name, flags in (("bf16", ["--quantization", "none"]),
                        ("fp8", ["--quantization", "fp8", "--kv-cache-dtype", "fp8"])):
        out = tmp_path / f"{name}.json"
        assert e2e.main(["--lengths", "8192", "--reps", "1", "--throughput", "64x8192", "--token-budget", "65536",
                         "--skip-floor", "--check-len", "0", *flags, "--out", str(out)]) == 0
        walls[name] = json.loads(out.read_text())["throughput"]["wall_s"]
    ratio = walls["bf16"] / walls["fp8"]
    print(f"\n64 x 8K: bf16 {walls['bf16']:.2f} s, FP8 + FP8 pages + FP8 scores {walls['fp8']:.2f} s = {ratio:.3f}x")
    assert ratio >= 1.6  # bar


def _streamed(tmp_path, name: str, args: list[str]) -> dict:
    """One stream bench run in a process of its own (the 1M run needs the memory an earlier run's
    engine, pool and receiver would keep in this one)."""
    out = tmp_path / f"{name}.json"
    # What this process's earlier tests left in torch's caching allocator would stay held on the card
    # while the child runs (the 1M run ran out of memory after them on a 139 GiB H200).
    gc.collect()
    torch.cuda.empty_cache()
    cmd = [sys.executable, "-m", "prefill_server.bench.stream", *args, "--variants", "nixl", "--estimator-lengths",
           "", "--quantization", "fp8", "--out", str(out)]
    assert subprocess.run(cmd, timeout=400).returncode == 0, cmd
    res = json.loads(out.read_text())
    assert not res["errors"], res["errors"]
    assert res["check"] and res["check"]["pass"], res["check"]  # streamed K/V equal the pull path's
    return res


def test_fp8_streamed_128k_and_1m_within_their_bars(tmp_path):
    """Issue 20's long-prompt bars: at a fixed 2% mask, every layer's KV written over NIXL to a receiver
    in another process, TTFT of 128K within 2.5 s (FP8 linear layers) and of 1M within 25 s (FP8 linear
    layers in 32K-token chunks and FP8 scores). Recorded: 128K 2.19 s, 1M 24.09 s (H100,
    docs/bench/2026-12-07-stream-guard); H200 (docs/bench/2026-12-07-h200-confirm): 128K 2.17 s, 1M 23.63 s."""
    pytest.importorskip("nixl", reason="needs the NIXL wheels (scripts/gpu/lib.sh)")
    r128 = _streamed(tmp_path, "128k", ["--lengths", "131072", "--densities", "0.02", "--long", "", "--reps", "2"])
    r1m = _streamed(tmp_path, "1m", ["--lengths", "", "--long", "1048576", "--long-runs", "nixl:1",
                                     "--chunk-tokens", "32768", "--fp8-attention", "on"])
    ttft = {}
    for res in (r128, r1m):
        for row in res["summary"]["rows"]:
            if row["variant"] == "nixl":
                ttft[row["tokens"]] = (row["ttft_s"], row["peak_mem_gib"], row["meets_ttft_bar"])
    print(f"\nFP8, 2%, KV streamed over NIXL: TTFT s, peak GiB, bar met by tokens: {ttft}")
    assert ttft[131072][0] <= 2.5  # bar
    assert ttft[1 << 20][0] <= 25.0  # bar

"""Benchmark smoke tests for the GPU machine (marker ``gpu``: skipped on the CPU and not in the default
run). They run the two benchmark commands at reduced sizes on the Llama-3.1-8B shape and fail when a
number regresses past a recorded guard, printing what they measured:

    python3 -m pytest -q -m gpu tests/bench/test_gpu_bench_smoke.py -s     # ~2-3 minutes on one H200
    scripts/gpu/regression.sh      # the same, then the stream bench (the device call after CPU-side changes)

Guards: the issue's bar where the measurement has a margin over it; where a bar is marginal or not
met (dense 8K/32K at 1.14-1.24x of the burst floor, 64 x 8K throughput at 67-70%, docs/BENCHMARKS.md)
the guard sits a few percent past the recorded numbers (dense TTFT: against the sustained floor,
which holds still where the burst floor moves with the card), so a real regression trips it and
the run-to-run spread (+-2%) does not.
"""
from __future__ import annotations

import json

import pytest
import torch

from prefill_server.bench import attention, e2e

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _by_impl(results: list[dict], tokens: int) -> dict[str, dict]:
    return {r["impl"]: r for r in results if r["tokens"] == tokens}


def test_attention_bench_128k(tmp_path):
    """Kernel, estimator and all-blocks mode against cuDNN and FlexAttention in the same run, 128K at a
    fixed 5% mask. Recorded (calls 11-12): 1.35x Flex, 1.07-1.11x ideal, estimator + kernel
    16.5-17.0x dense, estimator 0.51% of dense, all blocks 0.97-1.00x cuDNN."""
    out = tmp_path / "attention.json"
    assert attention.main(["--lengths", "131072", "--densities", "0.05", "--budget-ms", "600",
                           "--out", str(out)]) == 0
    by = _by_impl(json.loads(out.read_text())["results"], 131072)
    ours, est, dense_mode = by["ours_kernel"], by["ours_estimator"], by["ours_dense_mode"]
    print(f"\n128K 5%: {ours['ms']:.2f} ms, {ours['speedup_vs_flex']:.2f}x Flex, {ours['vs_ideal']:.3f}x ideal, "
          f"total {ours['total_speedup_vs_dense']:.1f}x dense; estimator {est['frac_of_dense']:.2%} of dense; "
          f"all blocks {dense_mode['vs_cudnn']:.3f}x cuDNN")
    assert ours["speedup_vs_flex"] >= 1.2  # bar
    assert ours["vs_ideal"] <= 1.25  # bar
    assert ours["total_speedup_vs_dense"] >= 15  # bar
    assert est["frac_of_dense"] <= 0.01  # bar
    assert dense_mode["vs_cudnn"] <= 1.1  # guard (0.97-1.00 recorded; 1.11-1.14 before fixm)


def test_e2e_bench_dense_8k_32k_and_throughput(tmp_path):
    """The engine on random Llama-3.1-8B weights: the engine-vs-reference check, dense TTFT against the
    floors measured in the same run, and 16 x 8K concurrent requests against the linear-layer floor
    (64 x 8K recorded at 67.5-70%; bar 80%).

    The issue's bar is TTFT <= 1.15x the per-op floor (each op timed in a short burst): recorded
    1.135-1.165 at 8K/32K, but 1.215 / 1.202 on a GPU whose burst GEMMs ran at 782 instead of
    750 TFLOP/s while the engine's TTFT was unchanged (0.217 / 1.202 s; 2026-12-01): the burst floor
    moves with the card's clocks, the forward sits at the power cap. So the guard is on the same
    work run back to back (``--sustained-floor``: the engine's own overhead at the clocks it gets)."""
    out = tmp_path / "e2e.json"
    assert e2e.main(["--lengths", "8192,32768", "--reps", "3", "--check-len", "4096",
                     "--sustained-floor", "8192,32768",
                     "--throughput", "16x8192", "--token-budget", "65536", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["check"]["pass"] and res["check"]["argmax_equal"]
    ratios = {r["tokens"]: round(r["ratio"], 3) for r in res["ttft"]}
    sustained = {r["tokens"]: round(r["ratio_vs_sustained_floor"], 3) for r in res["ttft"]}
    tp = res["throughput"]["of_linear_floor"]
    print(f"\nTTFT / burst floor: {ratios}; TTFT / sustained floor: {sustained}; "
          f"16 x 8K: {tp:.1%} of the linear floor")
    assert sustained[8192] <= 1.13 and sustained[32768] <= 1.08  # guard (recorded 1.087 / 1.040)
    assert tp >= 0.62  # guard

"""``bench e2e`` at a tiny size on the CPU: the whole path runs and writes the JSON it promises. (The
fused GPU kernels it relies on are tested against the eager ops in tests/layers/test_fused.py.)"""
from __future__ import annotations

import json

import pytest

from prefill_server.bench import common, e2e
from prefill_server.bench.gpu_clocks import ClockSampler


def test_tiny_run_writes_json(tmp_path):
    out = tmp_path / "e2e.json"
    rc = e2e.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "32,48",
                   "--reps", "1", "--floor-reps", "1", "--check-len", "24", "--throughput", "3x16",
                   "--token-budget", "32", "--throughput-floor", "--profile-throughput", "2", "--throughput-densities", "0.5",
                   "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["meta"]["model"]["num_layers"] == 2 and not res["meta"]["fused_kernels"]
    # the engine's paged path equals the plain reference forward exactly in fp32
    assert res["check"]["pass"] and res["check"]["argmax_equal"]
    assert res["check"]["logits_rel_err"] < 1e-5 and res["check"]["k_rel_err_layer1"] < 1e-5
    assert [r["tokens"] for r in res["ttft"]] == [32, 48]
    for r in res["ttft"]:
        f = res["floor"][str(r["tokens"])]
        assert r["ttft_s"] > 0 and f["linear"]["ms"] > 0 and f["attention"]["ms"] > 0
        assert r["ratio"] == pytest.approx(r["ttft_s"] / f["floor_s"])
        assert len(f["linear"]["gemms_per_chunk"]) == 4
    tp = res["throughput"]
    assert tp["requests"] == 3 and tp["tokens_each"] == 16 and tp["wall_s"] > 0 and "of_linear_floor" in tp
    # two prompts per step, then one; the step floor runs 2 attention calls of 16 per layer
    assert [st["tokens"] for st in tp["steps"]] == [32, 16]
    sf = tp["step_floor"]
    assert sf["step_tokens"] == 32 and sf["steps"] == 1.5 and sf["sustained"]["attn_calls_per_layer"] == 2
    assert sf["sustained_gemms_only"]["attn_calls_per_layer"] == 0 and sf["sustained_floor_s"] > 0
    assert tp["ratio_vs_sustained_floor"] == pytest.approx(tp["wall_s"] / sf["sustained_floor_s"])
    (sp,) = tp["sparse"]
    assert sp["mode"] == "fixed-0.5" and sp["requests"] == 3 and sp["wall_s"] > 0 and "of_linear_floor" in sp
    assert tp["profile"]["requests"] == 2 and tp["profile"]["wall_ms_with_profiler"] > 0


def test_llama_8b_config_shape():
    c = common.model_config("llama-3.1-8b")
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (32, 4096, 32, 8, 128)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta) == (14336, 128256, 500000.0)
    assert c.rope_scaling is not None and c.rope_scaling.factor == 8.0
    # linear parameters per layer (what the floor's GEMMs multiply): ~218M, 6.98B over 32 layers
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    assert per_layer * c.num_layers == pytest.approx(6.98e9, rel=1e-2)


def test_clock_sampler_summarises_each_phase():
    """Samples land in the phase whose [start, next start) holds them; a phase without samples is left
    out; without NVML the summary says why instead of failing the bench."""
    cs = ClockSampler.__new__(ClockSampler)
    cs.error, cs.samples = None, [(10.0, 1980.0, 300.0), (10.5, 1800.0, 690.0), (20.0, 1400.0, 700.0)]
    got = cs.by_phase([["floor", 10.0], ["ttft_8192", 15.0], ["throughput", 19.0], ["end", 30.0]])
    assert got["floor"] == {"sm_mhz_mean": 1890, "sm_mhz_min": 1800.0, "sm_mhz_max": 1980.0,
                            "power_w_mean": 495.0, "power_w_max": 690.0, "samples": 2}
    assert "ttft_8192" not in got and got["throughput"]["samples"] == 1 and "end" not in got
    cs.samples, cs.error = [], "NVMLError: no driver"
    assert cs.by_phase([["floor", 0.0]]) == {"unavailable": "NVMLError: no driver"}

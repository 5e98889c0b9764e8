"""``bench e2e`` at a tiny size on the CPU: the whole path runs and writes the JSON it promises; and the
fused GPU kernels it relies on compute what the eager ops compute (Triton's interpreter)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from prefill_server.bench import e2e


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
    (sp,) = tp["sparse"]
    assert sp["mode"] == "fixed-0.5" and sp["requests"] == 3 and sp["wall_s"] > 0 and "of_linear_floor" in sp
    assert tp["profile"]["requests"] == 2 and tp["profile"]["wall_ms_with_profiler"] > 0


def test_llama_8b_config_shape():
    c = e2e.model_config("llama-3.1-8b")
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (32, 4096, 32, 8, 128)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta) == (14336, 128256, 500000.0)
    assert c.rope_scaling is not None and c.rope_scaling.factor == 8.0
    # linear parameters per layer (what the floor's GEMMs multiply): ~218M, 6.98B over 32 layers
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    assert per_layer * c.num_layers == pytest.approx(6.98e9, rel=1e-2)


_INTERPRETED = textwrap.dedent("""
    import torch, torch.nn.functional as F
    import triton.runtime.interpreter as ti
    orig = ti._patch_lang_tensor
    def patch(tensor, scope):  # Triton 3.6's interpreter vs NumPy >= 2.4 (triton-lang/triton#9171)
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    ti._patch_lang_tensor = patch
    from prefill_server.layers import fused
    from prefill_server.layers.rotary import RotaryEmbedding, apply_rotary
    torch.manual_seed(0)
    for dt in (torch.float32, torch.float16):
        t, hq, hkv, d = 5, 4, 2, 16
        x, w = torch.randn(t, 64).to(dt), (1 + 0.1 * torch.randn(64)).to(dt)
        xf = x.float()
        eager = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt)
        torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), eager)
        qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dt)
        cos, sin = RotaryEmbedding(d, 10000.0).cos_sin(torch.arange(t) + 3, dt)
        q, k, v = fused.rope_qkv(qkv, cos, sin, hq, hkv, d)
        eq, ek, ev = torch.split(qkv, [hq * d, hkv * d, hkv * d], -1)
        tol = {} if dt == torch.float32 else dict(atol=2e-3, rtol=2e-3)  # one rounding vs eager's three
        torch.testing.assert_close(q, apply_rotary(eq.reshape(t, hq, d), cos, sin), **tol)
        torch.testing.assert_close(k, apply_rotary(ek.reshape(t, hkv, d), cos, sin), **tol)
        assert torch.equal(v, ev.reshape(t, hkv, d))
        gu = torch.randn(t, 96).to(dt)
        g, u = gu.chunk(2, -1)
        torch.testing.assert_close(fused.silu_mul(gu), F.silu(g) * u)
        page = torch.full((4, hkv, 4, 2 * d), float("nan"), dtype=dt)
        ref = page.clone()
        blocks, offs = torch.tensor([2, 2, 2, 2, 0]), torch.tensor([0, 1, 2, 3, 0])
        assert fused.kv_write(page, blocks, offs, k, v)
        ref[blocks, :, offs, :d] = k
        ref[blocks, :, offs, d:] = v
        assert torch.equal(page.nan_to_num(7.0), ref.nan_to_num(7.0))
    print("ok")
""")


def test_fused_kernels_match_eager_ops_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")  # must be set before the kernels are defined
    p = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]

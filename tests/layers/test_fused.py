"""The fused Triton kernels (prefill_server/layers/fused.py) against the eager ops their callers run
off CUDA, through Triton's interpreter on the CPU (fp32 and fp16; bf16 ``tl`` math is wrong in the
interpreter, so bf16 is checked on the GPU). Shapes cover SmolLM2's and Llama-8B's head layouts and
the cases where a kernel declines (it must then write nothing and say so)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHECKS = textwrap.dedent("""
    import torch, torch.nn.functional as F
    import triton.runtime.interpreter as ti
    orig = ti._patch_lang_tensor
    def patch(tensor, scope):  # Triton 3.6's interpreter vs NumPy >= 2.4 (triton-lang/triton#9171)
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    ti._patch_lang_tensor = patch
    from prefill_server.layers import fused
    from prefill_server.layers.norm import RMSNorm
    from prefill_server.layers.rotary import RotaryEmbedding, apply_rotary
    torch.manual_seed(0)
    for dt in (torch.float32, torch.float16):
        tol = {} if dt == torch.float32 else dict(atol=3e-3, rtol=3e-3)  # one rounding vs eager's several
        # RMSNorm: the model's hidden sizes, a non-power-of-two row, 1 and many rows
        for rows, n in ((1, 576), (7, 64), (3, 100), (17, 4096)):
            norm = RMSNorm(n, eps=1e-5, dtype=dt)
            norm.weight.data = (1 + 0.1 * torch.randn(n)).to(dt)
            x = torch.randn(rows, n).to(dt)
            torch.testing.assert_close(fused.rms_norm(x, norm.weight, 1e-5), norm._native(x.float(), dt), **tol)
        assert fused.rms_norm(torch.randn(4, 64).to(dt).t(), torch.ones(4, dtype=dt), 1e-5) is None  # strided rows
        # rotary on one fused qkv projection: SmolLM2 (9/3 x 64), Llama-8B (32/8 x 128), MHA
        for t, hq, hkv, d in ((5, 9, 3, 64), (3, 32, 8, 128), (2, 4, 4, 16)):
            qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dt)
            cos, sin = RotaryEmbedding(d, 10000.0).cos_sin(torch.arange(t) + 11, dt)
            q, k, v = fused.rope_qkv(qkv, cos, sin, hq, hkv, d)
            eq, ek, ev = torch.split(qkv, [hq * d, hkv * d, hkv * d], -1)
            torch.testing.assert_close(q, apply_rotary(eq.reshape(t, hq, d), cos, sin), **tol)
            torch.testing.assert_close(k, apply_rotary(ek.reshape(t, hkv, d), cos, sin), **tol)
            assert torch.equal(v, ev.reshape(t, hkv, d))
        cos, sin = RotaryEmbedding(24, 10000.0).cos_sin(torch.arange(2), dt)
        assert fused.rope_qkv(torch.randn(2, 3 * 24).to(dt), cos, sin, 1, 1, 24) is None  # d/2 not a power of 2
        # SiLU and multiply
        for t, n in ((1, 1536), (6, 48), (4, 2500)):
            gu = torch.randn(t, 2 * n).to(dt)
            g, u = gu.chunk(2, -1)
            torch.testing.assert_close(fused.silu_mul(gu), F.silu(g.float()).to(dt) * u, **tol)
        # KV page write at scattered slots: what KVPool.write's eager indexing does
        for h, d in ((3, 64), (8, 128)):
            k, v = torch.randn(5, h, d).to(dt), torch.randn(5, h, d).to(dt)
            page = torch.full((4, h, 4, 2 * d), float("nan"), dtype=dt)
            ref = page.clone()
            blocks, offs = torch.tensor([2, 2, 2, 2, 0]), torch.tensor([0, 1, 2, 3, 0])
            assert fused.kv_write(page, blocks, offs, k, v)
            ref[blocks, :, offs, :d] = k
            ref[blocks, :, offs, d:] = v
            assert torch.equal(page.nan_to_num(7.0), ref.nan_to_num(7.0))
        page = torch.zeros(2, 1, 4, 48, dtype=dt)
        assert not fused.kv_write(page, torch.tensor([0]), torch.tensor([0]), torch.ones(1, 1, 24, dtype=dt),
                                  torch.ones(1, 1, 24, dtype=dt)) and not page.any()  # head_dim not a power of 2
    print("ok")
""")


def test_fused_kernels_match_the_eager_ops():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")  # must be set before the kernels are defined
    p = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def test_fused_paths_are_off_the_cpu_and_can_be_switched_off():
    import torch

    from prefill_server.layers import fused

    x = torch.randn(2, 8)
    assert not fused.available(x)  # CPU tensors always take the eager path
    with fused.enabled(False):
        assert not fused.available(x)

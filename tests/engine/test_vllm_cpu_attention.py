"""vLLM's CPU attention kernel as our CPU dense path (--cpu-attention vllm), against plain PyTorch.

Needs vLLM's compiled ops from the decode venv (.venv-vllm, scripts/setup.sh); skipped without it.
Bit equality with a real vllm-cpu decode is checked end to end (tests/e2e/test_pipeline.py bf16).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefill_server.layers import attention as attn_mod
from prefill_server.layers import vllm_cpu_attention as vca
from prefill_server.local_vllm import vllm_package_dir

VLLM_DIR = vllm_package_dir()
needs_vllm = pytest.mark.skipif(VLLM_DIR is None or vca.find_library(str(VLLM_DIR)) is None,
                                reason="no vLLM CPU ops in .venv-vllm (scripts/setup.sh)")


@pytest.fixture
def cpu_backend_reset():
    yield
    attn_mod._cpu.update(backend="torch", block_size=32)


def reference(q, k, v, scale):
    """fp32 causal attention, bottom-right aligned; q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, D]."""
    tq, tk = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    qh = q.float().transpose(0, 1)
    kh, vh = (x.float().transpose(0, 1).repeat_interleave(rep, 0) for x in (k, v))
    mask = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(0, 1)


@needs_vllm
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("tq,tk,hq,hkv,d", [(70, 70, 9, 3, 64), (33, 300, 9, 3, 64), (1, 97, 8, 8, 128),
                                            (200, 200, 4, 1, 64)])
def test_matches_fp32_reference(dtype, tol, tq, tk, hq, hkv, d):
    vca.load(str(VLLM_DIR))
    g = torch.Generator().manual_seed(tq * 1000 + tk)
    q = torch.randn(tq, hq, d, generator=g).to(dtype)
    k = torch.randn(tk, hkv, d, generator=g).to(dtype)
    v = torch.randn(tk, hkv, d, generator=g).to(dtype)
    o = vca.attention(q, k, v, d ** -0.5, block_size=32)
    assert o.shape == q.shape and o.dtype == dtype
    ref = reference(q, k, v, d ** -0.5)
    err = (o.float() - ref).abs().max().item()
    assert err <= tol, err
    if dtype == torch.bfloat16 and vca.find_library(str(VLLM_DIR)).name.startswith("_C."):
        # the AVX-512 + bf16 build computes in fp32 and rounds once: nearly every element is the
        # rounded reference. (The AVX2 build, loaded on CPUs without AVX-512, rounds along the way:
        # about half differ, within the tolerance above: test_avx2_build_in_a_subprocess.)
        assert (o != ref.to(dtype)).float().mean().item() < 0.01


AVX2_CHECK = """
import json, sys, torch
from prefill_server.layers import vllm_cpu_attention as vca
sys.path.insert(0, {tests!r})
from test_vllm_cpu_attention import reference
vca.load({lib!r})
out = []
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1.6e-2)):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, h, 64, generator=g).to(dtype) for n, h in ((33, 9), (300, 3), (300, 3)))
    o = vca.attention(q, k, v, 0.125, block_size=32)
    out.append((str(dtype), (o.float() - reference(q, k, v, 0.125)).abs().max().item(), tol))
print(json.dumps(out))
"""


@needs_vllm
def test_avx2_build_in_a_subprocess():
    """vLLM's AVX2 build (what a CPU without AVX-512 loads) runs on every x86 CI machine: its
    results are checked against the fp32 reference within the same tolerances (one library per
    process, hence the subprocess)."""
    import json
    import pathlib
    import subprocess
    import sys

    lib = VLLM_DIR / next(p.name for p in VLLM_DIR.glob("_C_AVX2.*so"))
    code = AVX2_CHECK.format(tests=str(pathlib.Path(__file__).parent), lib=str(lib))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for dtype, err, tol in json.loads(r.stdout.splitlines()[-1]):
        assert err <= tol, (dtype, err)


@needs_vllm
def test_dense_attention_dispatches_to_vllm_kernel(cpu_backend_reset):
    assert attn_mod.set_cpu_backend("vllm", str(VLLM_DIR), block_size=32) == "vllm"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(50, h, 64, generator=g).bfloat16() for h in (9, 3, 3))
    ours = attn_mod.dense_attention(q, k, v, 0.125)
    assert torch.equal(ours, vca.attention(q, k, v, 0.125, 32))


def test_missing_library_is_a_clear_error(tmp_path, cpu_backend_reset):
    with pytest.raises(ValueError, match="--cpu-attention torch"):
        attn_mod.set_cpu_backend("vllm", str(tmp_path))
    assert attn_mod._cpu["backend"] == "torch"


def test_auto_without_vllm_here_is_torch(cpu_backend_reset):
    if vca.find_library() is not None:
        pytest.skip("vllm is importable in this environment")
    assert attn_mod.set_cpu_backend("auto") == "torch"


def test_config_rejects_unknown_backend():
    from prefill_server.config import EngineConfig

    with pytest.raises(ValueError, match="--cpu-attention"):
        EngineConfig(cpu_attention="fast").validate()
    with pytest.raises(ValueError, match="--cpu-threads"):
        EngineConfig(cpu_threads=-1).validate()


@needs_vllm
def test_query_chunk_splits_like_a_chunked_decode():
    """Whole prompt with query_chunk=64 == the kernel on [0, 64) then [64, 130) against keys [0, 130)."""
    vca.load(str(VLLM_DIR))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(130, h, 64, generator=g).bfloat16() for h in (9, 3, 3))
    whole = vca.attention(q, k, v, 0.125, 32, query_chunk=64)
    pieces = torch.cat([vca.attention(q[s:e], k[:e], v[:e], 0.125, 32) for s, e in ((0, 64), (64, 128), (128, 130))])
    assert torch.equal(whole, pieces)
    # a later chunk of a prompt (queries [100, 130)): split at 128
    tail = vca.attention(q[100:], k, v, 0.125, 32, query_chunk=64)
    assert torch.equal(tail, torch.cat([vca.attention(q[100:128], k[:128], v[:128], 0.125, 32),
                                        vca.attention(q[128:], k, v, 0.125, 32)]))
    assert (whole.float() - reference(q, k, v, 0.125)).abs().max().item() < 1.6e-2

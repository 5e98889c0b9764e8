"""Sparse vs dense on a real model: SmolLM2-135M-Instruct (the embedded default), real English text
(Debian's licence files), CPU, torch backend of the estimator + attention (the selection the Triton
estimator reproduces exactly, see test_block_sparse_triton.py).

Slow (a few CPU minutes per 8K-token forward): ``pytest -m slow tests/kernels/test_accuracy_smollm2.py``.
Numbers and the density chosen: docs/BENCHMARKS.md ("Accuracy on SmolLM2").
"""
import pytest
import torch

from prefill_server.kernels.block_sparse import SparseConfig

pytestmark = pytest.mark.slow

acc = pytest.importorskip("bsa_accuracy")


@pytest.fixture(scope="module")
def smollm():
    if not acc.available():
        pytest.skip("Debian licence texts not found under /usr/share/common-licenses")
    try:
        return acc.load()
    except Exception as e:  # noqa: BLE001 (model package missing on this machine)
        pytest.skip(f"SmolLM2 not available: {e}")


def test_top1_agreement_8k_default_config(smollm, record_property):
    """Default settings, 8192-token prompt (the model's context): >= 99% of the next-token argmaxes
    over the last 256 positions agree with dense attention."""
    _, model, tok = smollm
    ids = acc.text_ids(tok, "gpl3", 8192)
    agree, density, _ = acc.agreement(model, ids, SparseConfig(), last=256)
    record_property("density", density)
    record_property("top1_agreement", agree)
    print(f"top-1 agreement {agree:.4f} at mean density {density:.3f}")
    assert 0.0 < density < 1.0, "sparse path not exercised"
    assert agree >= 0.99


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_needle_8k_no_worse_than_dense(smollm, depth):
    """A passphrase hidden at ``depth`` of an 8K-token licence text, asked for at the end: whenever
    dense attention reproduces every answer token, sparse attention (defaults) does too."""
    _, model, tok = smollm
    hay = acc.text_ids(tok, "gfdl_lgpl", 8192 + 512)
    ids, n_ans = acc.needle_case(tok, hay, 8193, depth, acc.VALUES[0])  # forward on 8192 tokens
    dense_ok = acc.retrieved(model, ids, n_ans, acc.Dense())
    sparse = acc.Sparse(SparseConfig())
    sparse_ok = acc.retrieved(model, ids, n_ans, sparse)
    print(f"needle depth {depth}: dense {dense_ok}, sparse {sparse_ok}, mean density {sparse.mean_density():.3f}")
    assert sparse.mean_density() < 1.0, "sparse path not exercised"
    assert sparse_ok or not dense_ok

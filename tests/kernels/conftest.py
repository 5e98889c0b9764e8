"""Kernel tests: without CUDA, Triton kernels run in Triton's interpreter (fp16/fp32 only, small
shapes); tests marked ``gpu`` need CUDA and run at full size in bf16."""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit function is created (the kernel modules import lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:  # the torch reference path is still tested
    HAS_TRITON = False

if HAS_TRITON and not HAS_CUDA:
    # Triton 3.6's interpreter turns 1-element arrays into ints with int(arr), which NumPy >= 2.4
    # rejects; apply the upstream fix (triton-lang/triton#9171) for the test session.
    import triton.runtime.interpreter as _ti

    _orig_patch = _ti._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _ti._patch_lang_tensor = _patch_lang_tensor


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def triton_device():
    """Device the Triton kernels run on: CUDA, or CPU through the interpreter."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    return torch.device("cuda" if HAS_CUDA else "cpu")

"""What FP8 scores (q and k as e4m3 codes, one scale per tensor; ``kernel.attention`` with
``qk_descale``) cost SmolLM2-135M, beside FP8's linear layers: floor.py's comparison (top-1, KL,
confident top-1 against fp32 and bf16; docs/bench/2026-12-04-fp8-accuracy/) with two more variants.
CPU, emulated: the kernel computes exactly the attention of the dequantized q and k (its interpreter
test), so this is attention on dequantized e4m3 q and k, v and the output in bf16. From the root:

    .venv/bin/python docs/bench/2026-12-06-fp8-attention/accuracy.py --tokens 512 --last 128 \
        --variants fp32,bf16,bf16_qk8,fp8,fp8_qk8 --texts gpl3,held_out --out result_512.json

- bf16_qk8: floor.py's bf16 model with FP8 scores.
- fp8_qk8: floor.py's fp8 model (``--quantization fp8``'s linear layers) with FP8 scores.
- bf16_qk8s, fp8_qk8s: the same with the engine's static scales (``--kv-cache-dtype fp8`` with
  ``--fp8-attention``: q and k / 1.0 as e4m3 codes, saturating, as vLLM's FlashAttention-3 with an FP8
  cache) instead of one amax scale per tensor.
"""
from __future__ import annotations

import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "docs" / "bench" / "2026-12-04-fp8-accuracy"))
import floor  # noqa: E402  (its texts, variants, comparison and main)

from prefill_server.kernels.block_sparse.kernel import quantize_e4m3  # noqa: E402
from prefill_server.layers.fp8 import to_e4m3  # noqa: E402


class Fp8Scores(floor.acc.Dense):
    """q and k rounded to bf16, then to e4m3 with one scale per tensor; exact attention on their
    dequantized values with v in bf16; the output rounded to bf16. Records the bf16 q/k/v (what the
    decode is sent), so floor.kv_err compares like with like."""

    def __call__(self, layer, q, k, v):
        q, k, v = floor.bf16(q), floor.bf16(k), floor.bf16(v)
        if self.record:
            self.qkv[layer] = (q.clone(), k.clone(), v.clone())
        (q8, sq), (k8, sk) = quantize_e4m3(q), quantize_e4m3(k)
        return floor.bf16(floor.acc.Dense()(layer, q8.float() * sq, k8.float() * sk, v))


class Fp8StaticScores(Fp8Scores):
    """As Fp8Scores with the engine's static scales: q and k / 1.0 as saturating e4m3 codes."""

    def __call__(self, layer, q, k, v):
        q, k, v = floor.bf16(q), floor.bf16(k), floor.bf16(v)
        if self.record:
            self.qkv[layer] = (q.clone(), k.clone(), v.clone())
        return floor.bf16(floor.acc.Dense()(layer, to_e4m3(q).float(), to_e4m3(k).float(), v))


_build = floor.build


def build(name: str, base):
    if name.endswith("_qk8s"):
        model, _ = _build(name.removesuffix("_qk8s"), base)
        return model, Fp8StaticScores(record=True)
    if name.endswith("_qk8"):
        model, _ = _build(name.removesuffix("_qk8"), base)
        return model, Fp8Scores(record=True)
    return _build(name, base)


if __name__ == "__main__":
    floor.build = build  # floor.main builds each variant through this name
    with torch.no_grad():
        sys.exit(floor.main())

"""The floor of ``bench e2e``: what one prefill must cost on this device at the least, measured in
the same run. Linear layers at the best rate cuBLAS reaches on the model's own projections (each
timed alone on 4K-32K-row inputs) plus cuDNN SDPA causal attention at the prompt's length; and, with
``sustained``, the same work back to back as one forward runs it (a GPU at its power cap runs slower
clocks then). The matmul peak is reported beside it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from prefill_server.bench.common import _randn, time_ms
from prefill_server.models.config import ModelConfig
from prefill_server.models.llama import LlamaForCausalLM


def layer_gemms(model: LlamaForCausalLM) -> list[tuple[str, torch.Tensor]]:
    """(name, weight [out, in]) of one decoder layer's projections, in forward order."""
    layer = model.model.layers[0]
    return [("qkv_proj", layer.self_attn.qkv_proj.weight), ("o_proj", layer.self_attn.o_proj.weight),
            ("gate_up_proj", layer.mlp.gate_up_proj.weight), ("down_proj", layer.mlp.down_proj.weight)]


class Floor:
    """Floor terms measured on this device, cached per row count / length."""

    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, device, dtype, reps: int, seed: int = 1):
        self.model, self.cfg, self.device, self.dtype, self.reps = model, cfg, device, dtype, reps
        self.g = torch.Generator(device=device).manual_seed(seed)
        self._gemm: dict[int, dict] = {}

    def gemm_rows(self, rows: int) -> dict:
        """One layer's projections on ``rows`` token rows: ms and FLOPs per GEMM."""
        if rows not in self._gemm:
            out, total_ms, total_flops = [], 0.0, 0
            for name, w in layer_gemms(self.model):
                x = _randn((rows, w.shape[1]), self.device, self.dtype, self.g)
                ms, _ = time_ms(lambda: F.linear(x, w), self.device, self.reps)
                flops = 2 * rows * w.shape[0] * w.shape[1]
                out.append({"gemm": name, "m": rows, "n": w.shape[0], "k": w.shape[1], "ms": ms,
                            "tflops": flops / ms / 1e9})
                total_ms, total_flops = total_ms + ms, total_flops + flops
                del x
            self._gemm[rows] = {"ms": total_ms, "flops": total_flops, "gemms": out}
        return self._gemm[rows]

    ROWS = (4096, 8192, 16384, 32768)

    def linear(self, tokens: int) -> dict:
        """All linear layers for one prompt of ``tokens``, plus lm_head on the last token, at the
        best per-token rate cuBLAS reaches on the model's projections among row counts ``ROWS``
        (capped at ``tokens``): the engine's choice of chunk rows cannot lower this floor."""
        rows = sorted({min(tokens, r) for r in self.ROWS})
        per_row = {r: self.gemm_rows(r) for r in rows}
        best = min(rows, key=lambda r: per_row[r]["ms"] / r)
        layer_ms = per_row[best]["ms"] * tokens / best
        flops = per_row[best]["flops"] * tokens // best * self.cfg.num_layers
        head = self.model.lm_head.weight
        x1 = _randn((1, head.shape[1]), self.device, self.dtype, self.g)
        head_ms, _ = time_ms(lambda: F.linear(x1, head), self.device, self.reps)
        ms = layer_ms * self.cfg.num_layers + head_ms
        return {"ms": ms, "tflops": flops / ms / 1e9, "flops": flops, "lm_head_ms": head_ms, "best_rows": best,
                "layer_ms_by_rows": {str(r): per_row[r]["ms"] for r in rows},
                "tflops_by_rows": {str(r): per_row[r]["flops"] / per_row[r]["ms"] / 1e9 for r in rows},
                "gemms_per_chunk": per_row[best]["gemms"]}

    def attention(self, tokens: int, reps: int) -> dict:
        """One layer's causal attention at ``tokens`` through cuDNN SDPA (any SDPA backend on CPU),
        on [1, H, T, D] views of [T, H, D] tensors: the layout the engine passes."""
        c = self.cfg
        q = _randn((tokens, c.num_heads, c.head_dim), self.device, self.dtype, self.g)
        k = _randn((tokens, c.num_kv_heads, c.head_dim), self.device, self.dtype, self.g)
        v = _randn((tokens, c.num_kv_heads, c.head_dim), self.device, self.dtype, self.g)
        qh, kh, vh = (z.transpose(0, 1)[None] for z in (q, k, v))
        gqa = c.num_heads != c.num_kv_heads

        def f():
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=c.head_dim ** -0.5,
                                                  enable_gqa=gqa)
        if self.device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms, times = time_ms(f, self.device, reps)
            backend = "cudnn"
        else:
            ms, times = time_ms(f, self.device, reps)
            backend = "sdpa-default"
        flops = 4 * c.num_heads * c.head_dim * tokens * (tokens + 1) // 2  # causal: QK^T and PV
        return {"layer_ms": ms, "ms": ms * c.num_layers, "tflops": flops / ms / 1e9, "backend": backend,
                "reps_ms": times}

    def sustained(self, tokens: int, chunk: int, reps: int = 2, attn_len: int = 0,
                  attention: bool = True) -> dict:
        """The floor's work run back to back as a forward runs it (per layer: the projections on
        ``chunk``-row pieces, cuDNN attention at ``tokens``), nothing else: what the mandatory GEMMs
        and attention cost at the clocks the GPU holds under sustained load (its power cap), where
        the per-op floor above times each op in a short burst. ``attn_len``: a batched step's
        ``tokens`` are ``tokens // attn_len`` prompts of ``attn_len`` (one attention call each);
        ``attention=False``: the GEMMs alone."""
        c, dev, dt, g = self.cfg, self.device, self.dtype, self.g
        (_, wqkv), (_, wo), (_, wgu), (_, wd) = layer_gemms(self.model)
        rows = min(chunk, tokens)
        xs = [_randn((rows, w.shape[1]), dev, dt, g) for w in (wqkv, wo, wgu, wd)]
        alen = attn_len or tokens
        q = _randn((alen, c.num_heads, c.head_dim), dev, dt, g)
        k = _randn((alen, c.num_kv_heads, c.head_dim), dev, dt, g)
        v = _randn((alen, c.num_kv_heads, c.head_dim), dev, dt, g)
        qh, kh, vh = (z.transpose(0, 1)[None] for z in (q, k, v))
        n_chunks = (tokens + rows - 1) // rows
        n_attn = max(1, tokens // alen) if attention else 0

        def forward():
            for _ in range(c.num_layers):
                for _ in range(n_chunks):
                    F.linear(xs[0], wqkv)
                for _ in range(n_attn):
                    F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=c.head_dim ** -0.5,
                                                   enable_gqa=c.num_heads != c.num_kv_heads)
                for _ in range(n_chunks):
                    F.linear(xs[1], wo)
                    F.linear(xs[2], wgu)
                    F.linear(xs[3], wd)
        warmup = 1
        if dev.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                # a short forward (8K: 0.2 s) timed at once runs on a card not yet at its power cap,
                # at higher clocks than the engine's timed prefills get after the runs before them:
                # heat it first, HEAT_S of the same work (the sizing call counts), and time at least
                # TIMED_S of it
                one, _ = time_ms(forward, dev, 1, warmup=0)
                warmup = max(0, math.ceil(self.HEAT_S * 1e3 / one) - 1)
                reps = max(reps, math.ceil(self.TIMED_S * 1e3 / one))
                ms, times = time_ms(forward, dev, reps, warmup=warmup)
                warmup += 1
        else:
            ms, times = time_ms(forward, dev, reps)
        return {"tokens": tokens, "rows": rows, "attn_len": alen, "attn_calls_per_layer": n_attn, "ms": ms,
                "warmup_calls": warmup, "reps_ms": times}

    HEAT_S, TIMED_S = 3.0, 1.0  # (CUDA) seconds of the sustained work run untimed first, and timed


def matmul_peak(device, dtype, n: int, reps: int) -> dict:
    g = torch.Generator(device=device).manual_seed(2)
    a, b = _randn((n, n), device, dtype, g), _randn((n, n), device, dtype, g)
    ms, _ = time_ms(lambda: a @ b, device, reps)
    return {"n": n, "ms": ms, "tflops": 2 * n ** 3 / ms / 1e9}

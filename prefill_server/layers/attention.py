"""Attention dispatch: dense (fastest available path) or block-sparse for long prompts.

``dense_attention`` computes causal attention of a chunk of queries against all keys of the same
sequence, bottom-right aligned: query i (of Tq) sits at key position Tk - Tq + i. GQA is handled by
the kernels (no K/V repeat) where they allow it.

On a CUDA GPU in fp16/bf16 the whole-prompt case (Tq == Tk) goes to cuDNN's fused attention first
(FA3-class on Hopper: 1.7x PyTorch's FlashAttention-2 at 128K tokens; PyTorch's default order puts
cuDNN last), then flash / memory-efficient if cuDNN declines the inputs, on 4-D [1, H, T, D] views
(the earlier call, 3-D [H, T, D] with ``enable_gqa``, ran PyTorch's math backend, which
materializes the [H, T, T] scores: 1.98 s per 8K prefill of an 8B model, out of memory at 32K on an
H200). A later chunk of a prompt (Tq < Tk) needs a bottom-right causal mask, which the
memory-efficient kernel takes without materializing it; on the GPU it goes to flash directly
(bottom-right causal, native GQA: ``_sdpa_gpu``).

On the CPU, ``set_cpu_backend("vllm")`` routes dense attention to vLLM's CPU kernel (see
``vllm_cpu_attention``: faster than torch SDPA, and the decode's own bits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # optional: the `gpu` extra
    from flash_attn import flash_attn_varlen_func  # type: ignore
except Exception:  # pragma: no cover - depends on the install
    flash_attn_varlen_func = None

# Priority on CUDA (SDPA skips a backend that cannot take the inputs and tries the next).
GPU_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH]

_cpu = {"backend": "torch", "block_size": 32, "query_chunk": 0}  # set at engine build (set_cpu_backend)


def set_cpu_backend(name: str, where: str | None = None, block_size: int = 32, query_chunk: int = 0) -> str:
    """name: torch | vllm | auto (vllm when its ops load from this environment, else torch).
    block_size: the decode's KV block size (vLLM's kernel tiles by it). query_chunk: with vllm, split
    queries at absolute positions that are multiples of it, as a decode with that many batched
    tokens per step would (its kernel's bits depend on the split; 0 = no split). Returns the backend used."""
    from prefill_server.layers import vllm_cpu_attention

    if name == "auto":
        try:
            vllm_cpu_attention.load(where)
            name = "vllm"
        except ValueError:  # not in this environment, or not loadable here
            name = "torch"
    elif name == "vllm":
        vllm_cpu_attention.load(where)  # ValueError says what to change
    _cpu.update(backend=name, block_size=block_size, query_chunk=query_chunk)
    return name


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] (Tq <= Tk) -> o [Tq, Hq, D]."""
    tq, tk = q.shape[0], k.shape[0]
    assert tq <= tk, (tq, tk)
    if flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cq, ck = _cu_seqlens(q.device, tq, tk)
        return flash_attn_varlen_func(q, k, v, cq, ck, tq, tk, softmax_scale=scale, causal=True)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return _sdpa_gpu(q, k, v, scale)
    if _cpu["backend"] == "vllm" and q.device.type == "cpu":
        from prefill_server.layers import vllm_cpu_attention

        return vllm_cpu_attention.attention(q, k, v, scale, _cpu["block_size"], _cpu["query_chunk"])
    # [1, H, T, D] views: torch's fused CPU kernel takes only 4-D inputs; 3-D ones ran the math
    # backend, which materializes the scores (4.6x slower per layer at 1K tokens, 6.4x at 2K)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if tq == tk:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # bottom-right causal: key j visible to query i iff j <= (tk - tq) + i
        qi = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
        mask = torch.arange(tk, device=q.device)[None, :] <= qi  # [Tq, Tk]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


_CU_SEQLENS: dict = {}  # (device, tq, tk) -> cu_seqlens_q, cu_seqlens_k (made once: capture-safe)


def _cu_seqlens(device: torch.device, tq: int, tk: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, tq, tk)
    got = _CU_SEQLENS.get(key)
    if got is None:
        if len(_CU_SEQLENS) > 256:
            _CU_SEQLENS.clear()
        got = _CU_SEQLENS[key] = (torch.tensor([0, tq], dtype=torch.int32, device=device),
                                  torch.tensor([0, tk], dtype=torch.int32, device=device))
    return got


# A later chunk (Tq < Tk) through flash directly: flash's causal mask is bottom-right aligned and
# it takes GQA natively, so no K/V head expansion (the causal_lower_right bias dispatches to the
# same flash kernel, after repeat_interleave of K and V to Hq heads: 5.6 of 18.4 ms of GPU time of
# an 8K-token cache hit on the H200, docs/bench/2026-12-03-prefix-cache-profile/). Same kernel, same
# split count: bit-identical output. False once flash refused inputs (then the old path).
_FLASH_LATER_CHUNK = {"ok": True}


def _flash_later_chunk_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    d = q.shape[-1]
    return (_FLASH_LATER_CHUNK["ok"] and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention")
            and d % 8 == 0 and d <= 256 and q.shape[1] % k.shape[1] == 0 and q.dtype == k.dtype
            and q.stride(-1) == 1 and k.stride(-1) == 1)


def _sdpa_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> o [Tq, Hq, D], through [1, H, T, D] views (no copies)."""
    tq, tk = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = q.shape[1] != k.shape[1]
    if tq == tk:
        with sdpa_kernel(GPU_BACKENDS, set_priority=True):
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)
    if _flash_later_chunk_ok(q, k) and v.stride(-1) == 1:
        try:
            o = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, True, False, scale=scale)[0]
            return o[0].transpose(0, 1)
        except RuntimeError:  # this build's flash takes no GQA / these inputs: the expanding path
            if torch.cuda.is_current_stream_capturing():
                raise  # (a graph capture fails as a whole: the caller runs the step eagerly)
            _FLASH_LATER_CHUNK["ok"] = False
    from torch.nn.attention.bias import causal_lower_right
    if gqa:  # the causal-bias dispatch takes no enable_gqa everywhere: expand K/V heads
        rep = q.shape[1] // k.shape[1]
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(tq, tk), scale=scale)
    return o[0].transpose(0, 1)

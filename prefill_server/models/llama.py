"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 via config flags) in plain PyTorch.

The model sees one flattened batch: T tokens of several sequences concatenated, with their
positions. It never sees the batch structure: attention is a callable supplied by the caller,
``attn(layer, q, k, v) -> o``, which knows the sequences, writes K/V to its cache and attends over
cached + new tokens. q/k/v/o shapes: q, o [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim];
k is post-rope (and post q/k-norm for Qwen3), v is raw.

Numerics follow vLLM's kernels, whose KV the decode would otherwise compute itself: RMSNorm, rope
and SiLU-and-multiply in float32 with one rounding to the model dtype (transformers rounds after
each op: up to one bf16 ulp apart), rope cos/sin from float32 angles cast to the model dtype,
residual stream in the model dtype. In float32 both agree to float32 rounding.

With ``--quantization fp8`` the projections are ``layers.fp8.Fp8Linear`` and, on CUDA, the norms and
SiLU-and-multiply in front of them write FP8 codes directly (``fp8.rms_norm_for``, ``silu_mul_for``).

On CUDA the elementwise work runs as single-pass kernels (``layers.fused``: norm, rope + v copy
straight into the whole-prompt q/k/v buffers, SiLU-and-multiply) and the residual adds ride in the
GEMM epilogue (``addmm``), which rounds once where eager rounds twice; the CPU path is plain PyTorch.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from prefill_server.layers import fp8, fused
from prefill_server.layers.linear import Linear, MergedLinear
from prefill_server.layers.norm import RMSNorm
from prefill_server.layers.rotary import RotaryEmbedding, apply_rotary
from prefill_server.models.config import ModelConfig


class AttentionFn(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k8: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> o [T, Hq, D]. With FP8 scores (``fp8_scores`` below) q is
        given as e4m3 codes of q / q_scale and k8 [T, Hkv, D] as the codes of k / k_scale."""
        ...

    # optional: (q_scale, k_scale) when layer ``layer`` takes FP8 scores (CUDA only), else None
    # def fp8_scores(self, layer: int) -> tuple[float, float] | None


# Checkpoint (HF) projections that we fuse into one Linear each, in concatenation order.
FUSED_PARAMS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

# Token rows processed at once in the non-attention parts of a layer: bounds the activation
# memory of long prompts (the MLP's [T, 2 * intermediate] is the largest) without changing results.
# 8192: on the H200 an 8B model's prefill is as fast as with 16384-row chunks (1.224 vs 1.226 s at
# 32K tokens, docs/e2e-gpu-notes.md) with 0.7 GiB less activation memory.
DEFAULT_CHUNK_TOKENS = 8192


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size],
                                     bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out=None,
                fp8_scales: tuple[float, float] | None = None):
        """x [T, hidden] (already normed) -> q [T, Hq, D], k [T, Hkv, D] (roped), v [T, Hkv, D];
        written into ``out`` (q, k, v tensors of T rows) when given. fp8_scales (q_scale, k_scale):
        q as e4m3 codes and a fourth tensor, k's codes (``fused.rope_qkv``); ``out`` has four then."""
        t = x.shape[0]
        if self.q_norm is None and fused.available(x):  # one pass: rope q and k, copy v
            r = fused.rope_qkv(self.qkv_proj(x), cos, sin, self.num_heads, self.num_kv_heads,
                               self.head_dim, out, fp8_scales)
            if r is not None:
                return r
        q, k, v = self.qkv_proj.forward_split(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim).contiguous()
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        res = (q, k, v)
        if fp8_scales:
            res = (fp8.to_e4m3(q, fp8_scales[0]), k, v, fp8.to_e4m3(k, fp8_scales[1]))
        if out is None:
            return res
        for dst, src in zip(out, res):
            dst.copy_(src)
        return out

    def output(self, o: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o [T, Hq * D], residual [T, hidden] -> residual + o_proj(o) [T, hidden]; on CUDA
        accumulated into ``residual`` in place by the GEMM (beta = 1), elsewhere a new tensor."""
        return self.o_proj.forward_add(o, residual, out=residual if fused.available(o) else None)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> mlp(x) [T, hidden]; with ``residual``: residual + mlp(x), into ``out``."""
        if fused.available(x):
            act = fp8.silu_mul_for(self.down_proj, self.gate_up_proj(x))  # [T, inter] (FP8 for an FP8 down_proj)
            if residual is None:
                return self.down_proj(act)
            return self.down_proj.forward_add(act, residual, out=out)  # out is residual: in place
        gate, up = self.gate_up_proj.forward_split(x)  # [T, inter] each
        y = self.down_proj(F.silu(gate) * up)  # [T, hidden]; rounded after silu and after the
        #                                        product, as vLLM's x86 CPU SiluAndMul (forward_native)
        if residual is None:
            return y
        return residual + y if out is None else torch.add(residual, y, out=out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionFn, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, hidden]: the residual stream; delta [T, hidden] or None: the previous layer's MLP
        output, not yet added to x. Returns (x, delta) for the next layer; may update x in place.

        Off CUDA the adds happen inside the norms, as in vLLM (``RMSNorm.add_forward``); on CUDA
        they are fused into the GEMMs and delta is always None."""
        if fused.available(x):
            return self._forward_fused(x, cos, sin, attn, chunk), None
        sa = self.self_attn
        t = x.shape[0]
        q = x.new_empty(t, sa.num_heads, sa.head_dim)
        k = x.new_empty(t, sa.num_kv_heads, sa.head_dim)
        v = x.new_empty(t, sa.num_kv_heads, sa.head_dim)
        for s in range(0, t, chunk):
            e = min(t, s + chunk)
            if delta is None:
                normed = self.input_layernorm(x[s:e])
            else:
                normed, x[s:e] = self.input_layernorm.add_forward(delta[s:e], x[s:e])
            sa.project(normed, cos[s:e], sin[s:e], out=(q[s:e], k[s:e], v[s:e]))
        o = attn(sa.layer, q, k, v).reshape(t, -1)  # [T, Hq * D]
        del q, k, v
        mlp_out = torch.empty_like(x) if delta is None else delta
        for s in range(0, t, chunk):
            e = min(t, s + chunk)
            normed, x[s:e] = self.post_attention_layernorm.add_forward(sa.o_proj(o[s:e]), x[s:e])
            mlp_out[s:e] = self.mlp(normed)
        return x, mlp_out

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn,
                       chunk: int) -> torch.Tensor:
        """CUDA: x [T, hidden] -> [T, hidden], residual adds fused into the o_proj / down GEMMs."""
        sa = self.self_attn
        t = x.shape[0]
        scores8 = getattr(attn, "fp8_scores", None)
        f8 = scores8(sa.layer) if scores8 is not None else None  # (q_scale, k_scale) or None
        if t <= chunk:
            qkv = sa.project(fp8.rms_norm_for(sa.qkv_proj, self.input_layernorm, x), cos, sin, fp8_scales=f8)
        else:  # project chunk by chunk straight into whole-prompt buffers
            qkv = (x.new_empty(t, sa.num_heads, sa.head_dim, dtype=torch.float8_e4m3fn if f8 else x.dtype),
                   x.new_empty(t, sa.num_kv_heads, sa.head_dim), x.new_empty(t, sa.num_kv_heads, sa.head_dim))
            if f8:
                qkv = (*qkv, x.new_empty(t, sa.num_kv_heads, sa.head_dim, dtype=torch.float8_e4m3fn))
            for s in range(0, t, chunk):
                e = s + chunk
                sa.project(fp8.rms_norm_for(sa.qkv_proj, self.input_layernorm, x[s:e]), cos[s:e], sin[s:e],
                           out=tuple(z[s:e] for z in qkv), fp8_scales=f8)
        o = attn(sa.layer, *qkv[:3], **({"k8": qkv[3]} if f8 else {}))  # [T, Hq, D]
        del qkv
        o = o.reshape(t, -1)  # [T, Hq * D]
        for s in range(0, t, chunk):
            xs = x[s:s + chunk]
            h = sa.output(o[s:s + chunk], xs)  # xs + o_proj(o) (xs itself on CUDA)
            normed = fp8.rms_norm_for(self.mlp.gate_up_proj, self.post_attention_layernorm, h)
            self.mlp(normed, residual=h, out=xs)  # xs <- h + mlp(norm(h))
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names match the HF checkpoint except the fused ``qkv_proj`` and ``gate_up_proj``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.chunk_tokens = DEFAULT_CHUNK_TOKENS
        if cfg.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> float32 logits [B, vocab] for rows ``logits_indices`` [B]
        (all T rows if None)."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [T, D] each
        delta = None  # the last MLP output, not yet added to x (off CUDA)
        for layer in self.model.layers:
            x, delta = layer(x, delta, cos, sin, attn, self.chunk_tokens)
        if logits_indices is not None:
            x = x[logits_indices]  # [B, hidden]
            delta = None if delta is None else delta[logits_indices]
        h = self.model.norm(x) if delta is None else self.model.norm.add_forward(delta, x)[0]
        return self.lm_head(h).float()  # [B, vocab]

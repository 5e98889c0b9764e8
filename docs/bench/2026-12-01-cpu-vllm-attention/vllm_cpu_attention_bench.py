"""(Recorded CPU measurement, kept here with its data; until 2026-12-02 it lived in the scripts folder.)
vLLM's CPU attention kernel (``--cpu-attention vllm``) vs torch SDPA on this CPU: time per call,
and how its bf16 bits depend on query chunking and the OpenMP thread count. Writes JSON.

    .venv/bin/python docs/bench/2026-12-01-cpu-vllm-attention/vllm_cpu_attention_bench.py [--tokens 3000] [--out FILE]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64), bf16, causal, random
inputs; vLLM's ops from .venv-vllm (scripts/setup.sh). Times: median of --reps calls.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from prefill_server.layers import vllm_cpu_attention as vca
from prefill_server.local_vllm import vllm_package_dir

HQ, HKV, D, BLOCK = 9, 3, 64, 32


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def sdpa(q, k, v, scale):
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def median_s(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--chunk", type=int, default=2048, help="query chunk of the chunked variant")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="vllm_cpu_attention_bench.json")
    a = ap.parse_args()
    lib = vca.load(str(vllm_package_dir()))
    g = torch.Generator().manual_seed(1)
    n, scale = a.tokens, D ** -0.5
    q = (torch.randn(n, HQ, D, generator=g) * 1.5).bfloat16()
    k = (torch.randn(n, HKV, D, generator=g) * 1.5).bfloat16()
    v = torch.randn(n, HKV, D, generator=g).bfloat16()
    threads = torch.get_num_threads()
    res = {"tokens": n, "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D}, "dtype": "bfloat16",
           "threads": threads, "cpu": cpu_model(), "cores": os.cpu_count(), "vllm_ops": lib,
           "torch": torch.__version__, "reps": a.reps}
    res["sdpa_s"] = median_s(lambda: sdpa(q, k, v, scale), a.reps)
    res["vllm_kernel_s"] = median_s(lambda: vca.attention(q, k, v, scale, BLOCK), a.reps)
    res["speedup"] = res["sdpa_s"] / res["vllm_kernel_s"]
    whole = vca.attention(q, k, v, scale, BLOCK)
    ref = sdpa(q.float(), k.float(), v.float(), scale).bfloat16()  # fp32 math, one rounding
    res["outputs"] = whole.numel()
    res["differ_vs_fp32_rounded_once"] = int((whole != ref).sum())
    res["differ_vs_sdpa_bf16"] = int((whole != sdpa(q, k, v, scale)).sum())
    res[f"differ_chunked_{a.chunk}_vs_whole"] = int((vca.attention(q, k, v, scale, BLOCK, a.chunk) != whole).sum())
    torch.set_num_threads(1)
    one = vca.attention(q, k, v, scale, BLOCK)
    torch.set_num_threads(threads)
    res[f"differ_1_thread_vs_{threads}"] = int((one != whole).sum())
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

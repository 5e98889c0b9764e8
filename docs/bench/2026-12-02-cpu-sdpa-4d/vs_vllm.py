"""vLLM's CPU attention kernel (``--cpu-attention vllm``) against torch SDPA as ``dense_attention``
now calls it (4-D views), SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64), causal, whole
prompts, fp32 and bf16, 2 threads. Median of 5 after a warm-up. vLLM's ops from .venv-vllm.

    .venv/bin/python docs/bench/2026-12-02-cpu-sdpa-4d/vs_vllm.py > docs/bench/2026-12-02-cpu-sdpa-4d/vs_vllm.json
"""
import json
import statistics
import time

import torch

from prefill_server.layers import attention, vllm_cpu_attention as vca
from prefill_server.local_vllm import vllm_package_dir


def timed(f, reps=5):
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1000


vca.load(str(vllm_package_dir()))
rows = []
for dtype in (torch.float32, torch.bfloat16):
    for n in (1024, 3000):
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(n, h, 64, generator=g).to(dtype) for h in (9, 3, 3))
        ms_torch = timed(lambda: attention.dense_attention(q, k, v, 0.125))
        ms_vllm = timed(lambda: vca.attention(q, k, v, 0.125, block_size=32))
        rows.append({"dtype": str(dtype), "tokens": n, "ms_torch_sdpa_4d": round(ms_torch, 2),
                     "ms_vllm": round(ms_vllm, 2), "vllm_speedup": round(ms_torch / ms_vllm, 2)})
print(json.dumps({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "library": str(vca.find_library(str(vllm_package_dir())).name), "rows": rows}, indent=1))

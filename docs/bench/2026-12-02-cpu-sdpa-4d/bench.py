"""torch SDPA on the CPU with SmolLM2's attention shape (9 query heads, 3 KV heads, head_dim 64,
fp32): 3-D [H, T, D] inputs with enable_gqa (what dense_attention passed before) against 4-D
[1, H, T, D] views (what it passes now), whole prompts (causal) and a later chunk (bottom-right
mask). Median of 7 after a warm-up; the outputs are compared.

    .venv/bin/python docs/bench/2026-12-02-cpu-sdpa-4d/bench.py > docs/bench/2026-12-02-cpu-sdpa-4d/result.json
"""
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F


def timed(f, reps=7):
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1000


rows = []
torch.manual_seed(0)
for tq, tk in ((512, 512), (1024, 1024), (2048, 2048), (1024, 2048)):
    q, k, v = torch.randn(tq, 9, 64), torch.randn(tk, 3, 64), torch.randn(tk, 3, 64)
    mask = None
    if tq < tk:
        mask = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
    kw = dict(is_causal=True) if mask is None else dict(attn_mask=mask)
    three = lambda: F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                   enable_gqa=True, **kw)
    four = lambda: F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], enable_gqa=True, **kw)[0]
    ms3, ms4 = timed(three), timed(four)
    rows.append({"q_tokens": tq, "k_tokens": tk, "ms_3d": round(ms3, 2), "ms_4d": round(ms4, 2),
                 "speedup": round(ms3 / ms4, 2), "max_abs_diff": float((three() - four()).abs().max())})
print(json.dumps({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "cpu": platform.processor() or platform.machine(), "per_layer": rows}, indent=1))

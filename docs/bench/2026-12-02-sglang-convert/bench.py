"""Converting one layer of our pool pages into SGLang's MHA layout on the GPU (issue 18):
``kv_transfer.sglang.target.ConvertArea.convert`` (whole pages: one slice or one index_select, then
one permuting copy of K and V together) against a per-token gather (what the first version did:
one gathered K and one gathered V, token by token through index tensors). Checked equal first.

Shape: 128K tokens x 8 KV heads x head_dim 128, bf16, pool block 16 (the Llama-3.1-8B layer).

    python docs/bench/2026-12-02-sglang-convert/bench.py --out result.json   # (on the H200)
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from kv_transfer.sglang.target import ConvertArea  # noqa: E402
from prefill_server.engine.kv_pool import KVPool  # noqa: E402

TOKENS, H, D, BS = 131072, 8, 128, 16


def per_token(pool: KVPool, pages: torch.Tensor) -> torch.Tensor:
    """The baseline: K and V gathered per token ([2, T, H, D])."""
    flat = pool.kv.view(-1, H, BS, 2 * D)
    tok_page = pages.repeat_interleave(BS)
    tok_slot = torch.arange(BS, device=pages.device).repeat(pages.numel())
    rows = flat[tok_page, :, tok_slot]  # [T, H, 2D]
    return torch.stack((rows[..., :D], rows[..., D:]))


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="result.json")
    args = ap.parse_args()
    nb = TOKENS // BS
    pool = KVPool(1, 2 * nb, H, BS, D, torch.bfloat16, device="cuda")
    pool.kv.normal_()
    area = ConvertArea(pool, TOKENS)
    consecutive = slice(0, nb)
    scattered = torch.randperm(2 * nb, device="cuda")[:nb]
    out = {"shape": {"tokens": TOKENS, "kv_heads": H, "head_dim": D, "block": BS, "dtype": "bfloat16"},
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, pages in (("consecutive", consecutive), ("scattered", scattered)):
        idx = torch.arange(nb, device="cuda") if isinstance(pages, slice) else pages
        area.convert(0, pages)
        want = per_token(pool, idx)
        got = area.tensor[0, :, :TOKENS]
        assert torch.equal(got, want), name
        ours = timed(lambda: area.convert(0, pages))
        base = timed(lambda: per_token(pool, idx))
        out[name] = {"convert_ms": ours, "per_token_gather_ms": base, "speedup": base / ours, "equal": True}
        print(name, out[name], flush=True)
    out["bytes_per_layer"] = 2 * TOKENS * H * D * 2
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

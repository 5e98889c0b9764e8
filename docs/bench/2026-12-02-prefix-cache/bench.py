"""32 requests sharing a 2048-token head, each with its own 128-token tail, one at a time through the
engine (SmolLM2-135M, CPU, fp32, transfer mode local): TTFT (submit -> KV leased) with the prefix
cache on and off. Run: .venv/bin/python docs/bench/2026-12-02-prefix-cache/bench.py > result.json"""
import json
import platform
import random
import statistics
import sys
import time

import torch

from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.engine.engine import Engine
from prefill_server.engine.local_producer import LocalProducer
from prefill_server.engine.types import PrefillRequest

HEAD, TAIL, N = 2048, 128, 32


def run(loaded, cache: bool, prompts) -> dict:
    cfg = EngineConfig(dtype="float32", num_kv_blocks=1024, block_size=16, token_budget=2048, prefix_cache=cache,
                       cpu_threads=2, cpu_attention="torch")
    pool = build.make_pool(cfg, loaded)
    build.configure_cpu(cfg, pool.block_size)
    eng = Engine(build.make_runner(loaded, pool), pool, LocalProducer(pool, 600), max_model_len=8192,
                 vocab_size=loaded.config.vocab_size, token_budget=2048, max_num_seqs=8, max_queue_wait_s=600)
    eng.warm_up(512)
    eng.start()
    ttft, cached, first = [], [], []
    try:
        for i, ids in enumerate(prompts):
            t0 = time.monotonic()
            res = eng.submit(PrefillRequest(f"r{i}", tuple(ids))).result(timeout=600)
            ttft.append(time.monotonic() - t0)
            cached.append(res.num_cached_tokens)
            first.append(res.first_token_id)
            print(f"cache {'on' if cache else 'off'} r{i}: {ttft[-1]:.3f} s, {res.num_cached_tokens} cached",
                  file=sys.stderr, flush=True)
            eng.abort(f"r{i}")  # the decode has read it
    finally:
        eng.stop()
    return {"prefix_cache": cache, "ttft_s": ttft, "mean_ttft_s": statistics.mean(ttft),
            "mean_ttft_after_first_s": statistics.mean(ttft[1:]), "cached_tokens": cached,
            "hit_rate": sum(cached) / sum(len(p) for p in prompts), "first_tokens": first}


def main() -> None:
    loaded = build.load(EngineConfig(dtype="float32", device="cpu"))
    text = open("/usr/share/common-licenses/GPL-3").read()
    ids = loaded.tokenizer.encode(text * 2)
    rng = random.Random(0)
    head = ids[:HEAD]
    prompts = [head + [rng.randrange(100, loaded.config.vocab_size) for _ in range(TAIL)] for _ in range(N)]
    off = run(loaded, False, prompts)
    on = run(loaded, True, prompts)
    out = {"workload": f"{N} requests, one at a time: a shared {HEAD}-token head + distinct {TAIL}-token tails",
           "model": "SmolLM2-135M-Instruct (embedded)", "dtype": "float32", "device": "cpu",
           "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
           "cores": __import__("os").cpu_count(), "command": " ".join(sys.argv),
           "speedup_mean_ttft": off["mean_ttft_s"] / on["mean_ttft_s"],
           "same_first_tokens": off["first_tokens"] == on["first_tokens"], "off": off, "on": on}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

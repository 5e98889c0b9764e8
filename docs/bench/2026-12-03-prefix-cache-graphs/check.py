"""Graph steps on the GPU (prefill_server/engine/graphs.py): each graph step against the eager step
(logits and the whole KV pool, bit for bit), the fall-back when a capture fails, step times eager vs
graph, and the graphs' memory. Llama-3.1-8B-shaped random bf16 weights, block size 16.

    export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
    python3 docs/bench/2026-12-03-prefix-cache-graphs/check.py --out $OUT/check.json
    .venv/bin/python docs/bench/2026-12-03-prefix-cache-graphs/check.py --preset tiny --device cpu \\
        --dtype float32 --head 256 --out /tmp/g.json        # smoke run (graphs run eagerly)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
from concurrent.futures import Future

import torch

from prefill_server.bench.common import model_config, random_model
from prefill_server.config import EngineConfig
from prefill_server.engine import build
from prefill_server.engine import graphs as graphs_mod
from prefill_server.engine.graphs import NOT_RUN, StepGraphs
from prefill_server.engine.scheduler import Chunk, Sequence
from prefill_server.engine.types import PrefillRequest
from prefill_server.layers import attention as attn_mod

T0 = time.monotonic()


def log(msg):
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def stats(xs):
    s = sorted(x * 1e3 for x in xs)
    return {"n": len(s), "mean": statistics.mean(s), "median": statistics.median(s), "min": s[0], "max": s[-1],
            "stdev": statistics.stdev(s) if len(s) > 1 else 0.0}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps, idle=0.0):
    wall, host = [], []
    for _ in range(reps):
        if idle:
            time.sleep(idle)
        sync(dev)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync(dev)
        wall.append(time.perf_counter() - t0)
        host.append(t1 - t0)
    return {"wall_ms": stats(wall), "host_ms": stats(host)}


def compare(got, ref):
    g, r = got.double(), ref.double()
    return {"bit_equal": bool(torch.equal(got, ref)), "max_abs": float((g - r).abs().max()),
            "rel": float((g - r).norm() / r.norm()), "argmax_eq": bool(got.argmax() == ref.argmax())}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--head", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "check.json"))
    args = ap.parse_args(argv)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = dev.type == "cuda"
    mcfg = model_config(args.preset)
    model = random_model(mcfg, dev, dtype, seed=0)
    loaded = build.LoadedModel("random", mcfg, model, None, dtype, dev)
    H = args.head
    base_n = 2 * H + 512
    cfg = EngineConfig(dtype=args.dtype, num_kv_blocks=-(-base_n // 16) + 4, block_size=16, prefix_cache=False)
    pool = build.make_pool(cfg, loaded)
    runner = build.make_runner(loaded, pool)
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev) if cuda else None,
           "runner_graphs_on": runner.graphs is not None, "cases": [], "command": " ".join(sys.argv)}
    runner.graphs = None  # the eager reference; graph steps through StepGraphs instances below

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    rng = random.Random(0)
    prompt = [rng.randrange(100, mcfg.vocab_size) for _ in range(base_n)]
    base = Sequence(PrefillRequest("base", tuple(prompt)), Future())
    base.block_ids = pool.allocate(pool.blocks_needed(base_n))
    runner.run([Chunk(base, 0, base_n)])
    sync(dev)
    log("model, pool and base prompt ready")

    def chunk(start, end):
        s = Sequence(PrefillRequest(f"c{start}-{end}", tuple(prompt[:end])), Future())
        s.block_ids = base.block_ids[:pool.blocks_needed(end)]
        return Chunk(s, start, end)

    def new_graphs():
        sg = StepGraphs(runner, capture=cuda)
        sg.CAPTURE_AFTER = 1
        return sg

    # ---- 1. graph step vs eager step: logits and the whole pool, at the capture and at a replay
    q = H // 2
    cases = [(H, 256), (H, 200), (H, 257), (q, 64), (q, 50), (H // 4, 1), (H + 16, 512), (H // 2 + 8, 100), (2 * H, 256)]
    sg = new_graphs()
    for start, t in cases:
        c = chunk(start, start + t)
        before = pool.kv.clone()
        ref = runner.run([c]).clone()
        kv_ref = pool.kv.clone()
        row = {"start": start, "t": t, "bucket": graphs_mod.bucket(t)}
        try:
            for phase in ("capture", "replay"):
                pool.kv.copy_(before)
                n0 = sg.stats["captures"]
                got = sg.run([c])
                assert got is not NOT_RUN, "graph step did not run"
                row[phase] = compare(got, ref)
                row[phase]["captured_now"] = sg.stats["captures"] > n0
                row[phase]["pool_bit_equal"] = bool(torch.equal(pool.kv, kv_ref))
                row[phase]["pool_elements_differing"] = int((pool.kv != kv_ref).sum())
        except Exception as e:
            row["error"] = repr(e)
            row["tb"] = traceback.format_exc()[-2000:]
        pool.kv.copy_(kv_ref)
        del before, kv_ref
        out["cases"].append(row)
        log(f"case {row}")
    out["graph_keys"] = [list(k) for k in sg.graphs]
    out["graph_stats"] = dict(sg.stats)
    save()

    # ---- 2. a capture that fails (a host sync inside the forward): eager result, device healthy
    orig_call = graphs_mod._StepAttention.__call__

    def syncing(self, layer, qq, k, v):
        if cuda and torch.cuda.is_current_stream_capturing():
            float(qq[0, 0, 0])  # a host sync: illegal while capturing
        return orig_call(self, layer, qq, k, v)

    fb = {}
    try:
        graphs_mod._StepAttention.__call__ = syncing
        c = chunk(H, H + 256)
        ref = runner.run([c]).clone()
        bad = new_graphs()
        runner.graphs = bad
        got = runner.run([c])
        fb = {"capture_failures": bad.stats["capture_failures"], "graphs": len(bad.graphs),
              "eager_result": compare(got, ref)}
        graphs_mod._StepAttention.__call__ = orig_call
        runner.graphs = None
        good = new_graphs()
        got2 = good.run([c])
        got3 = good.run([c])
        fb["after_failure_capture_ok"] = good.stats["captures"] == 1 and good.stats["replays"] == 1
        fb["after_failure_vs_eager"] = compare(got3, ref)
        del good
    except Exception as e:
        fb["error"] = repr(e)
        fb["tb"] = traceback.format_exc()[-2000:]
    finally:
        graphs_mod._StepAttention.__call__ = orig_call
        runner.graphs = None
    out["fallback"] = fb
    log(f"fallback {fb}")
    save()

    # ---- 3. step times: eager vs graph (incl. input copy and output clone), then variants
    tm = {}
    reps = args.reps
    try:
        for start, t in ((H, 256), (H, 512), (2 * H, 256), (H // 4, 64)):
            c = chunk(start, start + t)
            name = f"{start}+{t}"
            e = {"eager": timed(lambda: runner.run([c]), dev, reps)}
            e["eager_idle_0.25"] = timed(lambda: runner.run([c]), dev, 8, 0.25)
            g = new_graphs()
            g.run([c])
            e["graph"] = timed(lambda: g.run([c]), dev, reps)
            e["graph_idle_0.25"] = timed(lambda: g.run([c]), dev, 8, 0.25)
            tm[name] = e
            log(f"time {name}: eager {e['eager']['wall_ms']['median']:.2f} graph {e['graph']['wall_ms']['median']:.2f}")
            del g
        c = chunk(H, H + 200)
        g = new_graphs()
        g.run([c])
        tm[f"{H}+200 (bucket 256)"] = {"graph": timed(lambda: g.run([c]), dev, reps)}
        del g
        c = chunk(H, H + 256)
        pool.read_one_copy = False
        g = new_graphs()
        g.run([c])
        tm[f"{H}+256 read: gather + permute copy"] = {"graph": timed(lambda: g.run([c]), dev, reps)}
        pool.read_one_copy = True
        del g
        attn_mod._FLASH_LATER_CHUNK["ok"] = False
        g = new_graphs()
        g.run([c])
        tm[f"{H}+256 attention: repeat_interleave + causal_lower_right"] = {"graph": timed(lambda: g.run([c]), dev, reps)}
        tm[f"{H}+256 eager, repeat_interleave + causal_lower_right"] = {"eager": timed(lambda: runner.run([c]), dev, reps)}
        attn_mod._FLASH_LATER_CHUNK["ok"] = True
        del g
    except Exception as e:
        tm["error"] = repr(e)
        tm["tb"] = traceback.format_exc()[-2000:]
    finally:
        pool.read_one_copy = True
        attn_mod._FLASH_LATER_CHUNK["ok"] = True
    out["times"] = tm
    save()

    # ---- 4. memory of the graphs (one shared pool): reserved / allocated after each capture
    mem = {}
    if cuda:
        try:
            import gc
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            r0, a0 = torch.cuda.memory_reserved(dev), torch.cuda.memory_allocated(dev)
            g = new_graphs()
            g.MAX_GRAPHS = 8
            rows = []
            for start, t in ((H, 256), (H, 512), (H // 2, 64), (2 * H, 256), (2 * H, 512), (H + 16, 256)):
                g.run([chunk(start, start + t)])
                torch.cuda.synchronize()
                rows.append({"key": [start, graphs_mod.bucket(t)],
                             "reserved_mib": (torch.cuda.memory_reserved(dev) - r0) / 2**20,
                             "allocated_mib": (torch.cuda.memory_allocated(dev) - a0) / 2**20})
            mem = {"after_each_capture": rows, "capture_s_mean": g.stats["capture_s"] / max(1, g.stats["captures"])}
            del g
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            mem["reserved_mib_after_drop"] = (torch.cuda.memory_reserved(dev) - r0) / 2**20
        except Exception as e:
            mem["error"] = repr(e)
    out["memory"] = mem
    out["wall_s"] = time.monotonic() - T0
    save()

    print("== graph step vs eager (logits; whole pool) ==")
    for r in out["cases"]:
        if "error" in r:
            print(f"{r['start']}+{r['t']}: ERROR {r['error']}")
            continue
        cap, rep = r["capture"], r["replay"]
        print(f"{r['start']:6d}+{r['t']:3d} (rows {r['bucket']:3d}): capture bit {cap['bit_equal']} rel {cap['rel']:.2e} "
              f"pool {cap['pool_bit_equal']} | replay bit {rep['bit_equal']} rel {rep['rel']:.2e} max {rep['max_abs']:.3g} "
              f"argmax {rep['argmax_eq']} pool {rep['pool_bit_equal']} ({rep['pool_elements_differing']} differ)")
    print(f"fallback: {json.dumps({k: v for k, v in fb.items() if k != 'tb'})}")
    print("== step times, median [min-max] ms ==")
    for name, e in tm.items():
        if isinstance(e, dict):
            print(name + ": " + "; ".join(f"{k} {v['wall_ms']['median']:.2f} [{v['wall_ms']['min']:.2f}-"
                                          f"{v['wall_ms']['max']:.2f}] host {v['host_ms']['median']:.2f}"
                                          for k, v in e.items()))
        else:
            print(f"{name}: {e}")
    print(f"memory: {json.dumps(mem)}")
    print(f"wall {out['wall_s']:.1f} s")


if __name__ == "__main__":
    main()

"""``prefill-server bench e2e stream``: sparse-mode prefill end to end on one GPU, every layer's KV
streamed over NIXL into a receiver in another process (Llama-3.1-8B shape, random weights).

What runs: the real engine (``Engine.start_stream`` -> scheduler -> ``ModelRunner`` -> staging slots
-> ``PushProducer`` WRITE per layer) with the sparse adapter (``layers.sparse``: dense below
``dense_len_threshold`` and for the first layer(s) up to ``dense_first_layers_max_len`` tokens,
estimator + block-sparse kernel otherwise). The receiver (``bench/stream_receiver.py``) is a
``PushReceiver`` in a subprocess with its own caches.

Density, honestly. On random weights the estimator keeps nearly every block (pooled random vectors
score alike), so default settings give density ~1 here, far from what it keeps on a trained
model's attention. So two kinds of run, labelled in the JSON:
- ``estimator``: default ``SparseConfig``, the estimator's own selection (its density reported);
- ``fixed-<d>``: the estimator still runs at every sparse layer (its cost is paid, its density
  recorded), but the kernel computes a fixed mask of density d (sink + local + diagonal + random
  blocks, per KV head): the engine's time IF the estimator kept a fraction d of the blocks.
Which density the estimator keeps on a real 8B model at 128K-1M tokens is NOT measured here.

Transfer variants (same length and density):
- ``none``: the pull path, no transfer (K/V into the pool, blocks freed at once): the baseline;
- ``null-push``: the push path (staging slots, the per-layer wait for the layer's K/V) with a
  producer that sends nothing: what the push path costs by itself;
- ``nixl``: the engine's ``PushProducer`` -> receiver process (each layer's WRITE posted on the
  producer's poster thread once the layer's event completes: the forward's thread never waits);
- ``copy`` (instead of ``nixl`` when NIXL is not importable, or asked for): the same bytes copied to
  pinned host memory on a side CUDA stream, ordered by events: the lower bound of what hiding the
  transfer can cost.
(The finished experiments ``nixl-sync``, posting on the forward's thread, and ``nixl-reap``, a bench
thread polling every WRITE, were removed once measured: docs/e2e-gpu-notes.md, third slice.)

Parts: ``common.py`` (model, engine, timing, options), ``sparse.py`` (``BenchSparse``),
``stream_transfer.py`` (the producers of the variants, the receiver process), ``stream_receiver.py``
(that process).

    prefill-server bench e2e stream --lengths 131072 --long 1048576 --out stream.json
    prefill-server bench e2e stream --preset tiny --device cpu ...   # a smoke run (tests/bench)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import statistics
import sys
import time

import torch

from kv_transfer.base import Route
from prefill_server.bench.common import (DropProducer, _sync, _version, bench_args, drive, ints, model_args,
                                         model_config, random_model)
from prefill_server.bench.sparse import BenchSparse, sparse_config
from prefill_server.bench.stream_transfer import SECRET, CopyPush, NullPush, ReceiverProc
from prefill_server.engine.engine import Engine
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.runner import ModelRunner
from prefill_server.engine.scheduler import Chunk, Scheduler, Sequence
from prefill_server.engine.types import PrefillRequest

# Issue 20's bars at a fixed 2% mask (128K and 1M TTFT, KV streamed); streaming may add 5% at 128K.
TARGET_128K_S, TARGET_1M_S, TARGET_STREAM_RATIO = 2.5, 25.0, 1.05
FINGERPRINT = "bench:{preset}:random-weights"
VARIANTS = ("null-push", "nixl", "copy")  # the transfer variants (besides "none", always run)

# ---- one timed request ----
def _ids(cfg, n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist())


def timed_request(engines: dict, variant: str, n: int, rid: str, ids, device, receiver=None) -> dict:
    """Submit one prompt through ``engines[variant]`` (push variants: register it with the receiver
    at once, as a decode would), run the engine's steps on this thread; TTFT = submit -> first token
    with (push) every layer's WRITE done."""
    eng = engines[variant]
    _sync(device)
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0, m0 = time.perf_counter(), time.monotonic()
    if variant == "none":
        (res,) = drive(eng, [PrefillRequest(rid, ids)])
    else:
        fut, params = eng.start_stream(PrefillRequest(rid, ids, route=Route.STREAM))
        if receiver is not None and variant == "nixl":
            from kv_transfer.wire import PARAMS_KEY
            p = params[PARAMS_KEY]
            receiver.send(op="register", host=p["host"], port=p["port"], rid=rid, num_tokens=n)
        while eng.scheduler.has_work():
            chunks, _ = eng.scheduler.schedule()
            if not chunks:
                time.sleep(0.0002)  # the decode has not registered yet
                continue
            eng.step(chunks)
        res = fut.result(timeout=0)
    ttft = time.perf_counter() - t0
    m1 = time.monotonic()
    out = {"variant": variant, "tokens": n, "ttft_s": ttft, "queued_s": res.timings.queued_s,
           "prefill_s": res.timings.prefill_s, "first_token": res.first_token_id}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        out.update(peak_mem_gib=peak / 2**30, activation_peak_gib=(peak - base) / 2**30)
    if receiver is not None and variant == "nixl":
        ev = receiver.next(lambda e: e.get("rid") == rid and e["event"] in ("done", "failed"), 120)
        out["receiver"] = ev["event"] if ev["event"] == "failed" else "done"
        if ev["event"] == "done":
            posted = {layer: t for layer, t, _ in eng.producer.last_layer_times.get(rid, [])}
            arrive = ev["layer_t"]
            write = [arrive[i] - posted[i] for i in sorted(posted)]
            out.update(receiver_done_after_first_token_s=ev["t"] - m1,
                       write_s_median=statistics.median(write) if write else None,
                       write_s_max=max(write, default=None),
                       last_layer_posted_before_end_s=m1 - max(posted.values(), default=m1),
                       first_layer_arrived_after_submit_s=min(arrive) - m0)
    return out


def _check_streamed(engines, pool, receiver, cfg, n, device, sparse, seed) -> dict:
    """Streamed K/V (as the receiver process got them) vs the same prompt's K/V in the pool on the
    pull path, layers 0, 1 and last; and the same first token."""
    ids = _ids(cfg, n, seed)
    layers = sorted({0, 1, cfg.num_layers - 1})
    runner = engines["none"].runner
    runner.sparse = engines["nixl"].runner.sparse = sparse
    seq = Sequence(PrefillRequest("check-pull", ids), None)
    seq.block_ids = pool.allocate(pool.blocks_needed(n))
    try:
        logits = runner.run([Chunk(seq, 0, n)])
        ref = {layer: pool.read(layer, seq.block_ids, n) for layer in layers}
        ref = {layer: (k.cpu(), v.cpu()) for layer, (k, v) in ref.items()}
        token = int(logits[0].argmax())
    finally:
        pool.free(seq.block_ids)
    sparse.take_densities()
    r = timed_request(engines, "nixl", n, "check-push", ids, device, receiver)
    path = f"/tmp/bench_stream_check_{os.getpid()}.pt"
    receiver.send(op="dump", rid="check-push", num_tokens=n, layers=layers, path=path)
    receiver.next(lambda e: e["event"] == "dumped", 120)
    got = torch.load(path)
    os.remove(path)
    err = {}
    for layer in layers:
        for j, name in enumerate("kv"):
            a, b = got[layer][j].double(), ref[layer][j].double()
            err[f"{name}_rel_err_layer{layer}"] = float((a - b).norm() / b.norm().clamp_min(1e-30))
    ok = r.get("receiver") == "done" and r["first_token"] == token and max(err.values()) < 1e-3
    return {"tokens": n, "first_token_equal": r["first_token"] == token, **err, "pass": bool(ok)}


# ---- the run ----
def parse_args(argv):
    ap = argparse.ArgumentParser(prog="prefill-server bench e2e stream", description=__doc__.split("\n\n")[0])
    model_args(ap)
    ap.add_argument("--lengths", default="131072", help="lengths timed without transfer and streamed")
    ap.add_argument("--densities", default="0.01,0.02,0.05", help="fixed kernel densities, no-transfer runs")
    ap.add_argument("--stream-density", type=float, default=0.02, help="fixed density of the transfer variants")
    ap.add_argument("--variants", default="null-push,nixl",
                    help=f"transfer variants at --lengths, of {', '.join(VARIANTS)} (nixl falls back to copy "
                    "when NIXL is missing)")
    ap.add_argument("--estimator-lengths", default="131072",
                    help="lengths also run with the estimator's own selection (default settings)")
    ap.add_argument("--estimator-variant", default="nixl", help="transfer variant of those runs (or none)")
    ap.add_argument("--long", default="1048576", help="lengths run streamed only (the KV cannot be resident)")
    ap.add_argument("--long-runs", default="nixl:1",
                    help="variant:dense_first_layers for each --long run, in order (those layers run dense "
                         "only up to dense_first_layers_max_len keys: add it to --sparse for a dense first "
                         "layer at longer lengths)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--receiver-device", default="", help="receiver caches on (default: --device)")
    ap.add_argument("--ring-tokens", type=int, default=131072,
                    help="tokens per layer the receiver holds; longer prompts are written into them as a ring")
    ap.add_argument("--check-len", type=int, default=16384, help="streamed vs pull K/V check (0 = skip)")
    ap.add_argument("--block-size", type=int, default=16, help="KV page tokens (vLLM's default 16)")
    ap.add_argument("--sparse", default="", help="SparseConfig overrides, key=value,... (e.g. dense_first_layers=0)")
    ap.add_argument("--budget-s", type=float, default=0, help="skip runs predicted to end past this (0 = none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-tokens", type=int, default=0, help="model.chunk_tokens (0 = the model's default)")
    ap.add_argument("--quantization", default="none", choices=("none", "fp8"),
                    help="fp8: the projections in FP8, as serve --quantization fp8 (e2e: no floor, no check)")
    ap.add_argument("--fp8-attention", default="off", choices=("off", "on"),
                    help="on: FP8 scores (as serve --fp8-attention on: the pages stay bf16 here)")
    ap.add_argument("--out", default="bench_stream.json")
    a = ap.parse_args(argv)
    a.lengths, a.estimator_lengths, a.long = ints(a.lengths), ints(a.estimator_lengths), ints(a.long)
    a.densities = [float(x) for x in a.densities.split(",") if x.strip()]
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    a.long_runs = [(v.split(":")[0].strip(), int(v.split(":")[1])) for v in a.long_runs.split(",") if v.strip()]
    for v in a.variants + [v for v, _ in a.long_runs]:
        if v not in VARIANTS:
            ap.error(f"unknown transfer variant {v!r}: use {', '.join(VARIANTS)}")
    if a.estimator_variant not in VARIANTS + ("none",):
        ap.error(f"unknown --estimator-variant {a.estimator_variant!r}")
    return a

def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        return None


def _file_sha(mod_path: str) -> str:
    try:
        with open(mod_path, "rb") as f:
            return hashlib.sha1(f.read()).hexdigest()[:12]
    except OSError:
        return ""


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cfg = model_config(args.preset)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    t_start = time.perf_counter()
    scfg = sparse_config(args.sparse)
    from prefill_server.kernels import block_sparse as bsp
    kdir = os.path.dirname(bsp.__file__)
    res: dict = {"bench": "e2e-stream", "meta": {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "prefill-server bench e2e stream " + " ".join(args.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": _version("triton"),
        "nixl": {d: _dist_version(d) for d in ("nixl-cu12", "nixl-cu13")}, "preset": args.preset, "dtype": args.dtype,
        "quantization": args.quantization, "fp8_attention": args.fp8_attention,
        "chunk_tokens": args.chunk_tokens or None,
        "block_size": args.block_size, "sparse_config": dataclasses.asdict(scfg),
        "kernel_sha1": {f: _file_sha(os.path.join(kdir, f)) for f in ("api.py", "kernel.py", "estimate.py")},
        "env": {k: os.environ.get(k, "(unset)") for k in ("UCX_TLS", "UCX_MEMTYPE_CACHE", "UCX_MODULE_DIR",
                                                          "PYTORCH_CUDA_ALLOC_CONF", "NIXL_CUDA_MAJOR")},
        "targets": {"ttft_128k_s": TARGET_128K_S, "ttft_1m_s": TARGET_1M_S,
                    "stream_over_no_transfer_128k": TARGET_STREAM_RATIO}},
        "runs": [], "errors": {}, "skipped": []}
    try:
        from prefill_server.kernels.block_sparse import kernel as _k
        res["meta"]["kernel_launch"] = dict(_k.DEFAULTS)
    except Exception as e:  # noqa: BLE001
        res["meta"]["kernel_launch"] = f"unavailable: {e}"

    def log(*a):
        print(*a, file=sys.stderr, flush=True)

    def save():
        res["meta"]["elapsed_s"] = time.perf_counter() - t_start
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)

    model = random_model(cfg, device, dtype, args.seed, args.quantization)
    if args.chunk_tokens:
        model.chunk_tokens = args.chunk_tokens
    bs = args.block_size
    nb = lambda n: -(-n // bs)  # noqa: E731
    pull_len = max(args.lengths + args.estimator_lengths + [args.check_len])
    push_len = max(args.lengths + args.long + [args.check_len])
    pool = KVPool(cfg.num_layers, nb(pull_len) + 1, cfg.num_kv_heads, bs, cfg.head_dim, dtype, device)
    stage = KVPool(cfg.num_layers, -(-Scheduler.STREAM_SLOTS * nb(push_len) // cfg.num_layers) + 2,
                   cfg.num_kv_heads, bs, cfg.head_dim, dtype, device)
    res["meta"].update(weights_gib=sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30,
                       pull_pool_gib=pool.kv.numel() * pool.kv.element_size() / 2**30,
                       staging_pool_gib=stage.kv.numel() * stage.kv.element_size() / 2**30)
    mk = dict(max_model_len=1 << 20 if args.preset != "tiny" else 1 << 16, vocab_size=cfg.vocab_size,
              token_budget=pull_len, max_num_seqs=1, max_queue_wait_s=3600.0)

    def engine(pl, producer):
        stream_to = producer if Route.STREAM in producer.routes else None
        runner = ModelRunner(model, pl, cfg.head_dim, device, stream_to=stream_to, fp8_attention=args.fp8_attention)
        return Engine(runner, pl, producer, **mk)

    engines = {"none": engine(pool, DropProducer(pool)), "null-push": engine(stage, NullPush())}
    receiver = None
    try:
        from kv_transfer import wire
        from kv_transfer.push import PushProducer
        geometry = wire.Geometry(model_fingerprint=FINGERPRINT.format(preset=args.preset),
                                 num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                 block_size=bs, dtype=args.dtype)
        producer = PushProducer(stage, geometry, SECRET.encode(), register_timeout_s=60, transfer_timeout_s=120)
        producer.start()  # creates the NIXL agent, registers the staging pool
        import nixl._api as _nixl_api
        res["meta"]["nixl_module"] = getattr(_nixl_api.nixl_agent, "__module__", "?")
        engines["nixl"] = engine(stage, producer)
        rdev = args.receiver_device or device.type
        receiver = ReceiverProc(geometry, nb(min(args.ring_tokens, push_len)), rdev)
        res["meta"]["receiver"] = {"device": rdev, "cache_gib": receiver.info["cache_gib"],
                                   "ring_tokens": nb(min(args.ring_tokens, push_len)) * bs}
        log("receiver ready", receiver.info)
    except Exception as e:  # noqa: BLE001 - NIXL missing or broken here: measure what we can
        res["errors"]["nixl"] = f"{type(e).__name__}: {e}"
        log("NIXL unavailable, streaming falls back to the side-stream copy:", res["errors"]["nixl"])
        args.variants = list(dict.fromkeys("copy" if v == "nixl" else v for v in args.variants))
        args.long_runs = [("copy" if v == "nixl" else v, d) for v, d in args.long_runs]
        engines["copy"] = engine(stage, CopyPush(stage))
    if "copy" not in engines and "copy" in args.variants + [v for v, _ in args.long_runs] + [args.estimator_variant]:
        engines["copy"] = engine(stage, CopyPush(stage))
    log(f"model + pools ready in {time.perf_counter() - t_start:.1f} s")
    save()

    est = BenchSparse(scfg)
    fixed = {d: BenchSparse(scfg, d, args.seed) for d in sorted(set(args.densities + [args.stream_density]))}

    def one(variant, n, sparse, tag, seed, note=""):
        engines[variant].runner.sparse = sparse
        rid = f"{tag}-{variant}-{n}-{seed}"
        r = timed_request(engines, variant, n, rid, _ids(cfg, n, seed), device, receiver)
        r.update(mode=sparse.label, tag=tag, dense_first_layers=sparse.config.first_dense_layers(n),
                 estimator_density=sparse.take_densities(), note=note)
        if sparse.density is not None:
            r["kernel_density"] = sparse.mask_density.get(n)
        r["kv_bytes"] = cfg.num_layers * nb(n) * stage.block_bytes if variant != "none" else 0
        res["runs"].append(r)
        log(f"{tag:>8} {variant:>10} {n:>8} {sparse.label:>10} dfl={r['dense_first_layers']} "
            f"ttft {r['ttft_s']:.3f} s peak {r.get('peak_mem_gib', 0):.1f} GiB "
            f"est.density {r['estimator_density']['mean']}")
        save()
        return r

    def section(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - keep going: the other sections still measure
            import traceback
            res["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"section {name} failed:\n{traceback.format_exc()}")
            save()

    def fits(name, predicted_s):
        if args.budget_s and time.perf_counter() - t_start + predicted_s > args.budget_s:
            res["skipped"].append({"run": name, "predicted_s": predicted_s,
                                   "elapsed_s": time.perf_counter() - t_start})
            log(f"skipped {name}: predicted {predicted_s:.0f} s past the budget")
            return False
        return True

    # 1. correctness of the streamed K/V (and the kernels' compilation, off the clock)
    if args.check_len:
        def check():
            for sp in [est, fixed[args.stream_density]]:
                sp.prepare(args.check_len, cfg.num_kv_heads, cfg.head_dim, device)
                one("none", args.check_len, sp, "warmup", args.seed)
            if "nixl" in engines:
                res["check"] = _check_streamed(engines, pool, receiver, cfg, args.check_len, device, est, args.seed + 1)
                log("check", res["check"])
            for v in args.variants:  # every variant once, untimed (threads, first WRITEs)
                one(v, args.check_len, fixed[args.stream_density], "warmup", args.seed + 2)
        section("check", check)

    # 2. per length: fixed densities without transfer, then the transfer variants
    t128 = {}
    for n in args.lengths:
        def lengths(n=n):
            sd = fixed[args.stream_density]
            if "copy" in engines:
                engines["copy"].producer.reserve(n)
            for sp in fixed.values():
                sp.prepare(n, cfg.num_kv_heads, cfg.head_dim, device)
            one("none", n, sd, "warmup", args.seed + 3)
            for d in args.densities:
                for i in range(args.reps):
                    one("none", n, fixed[d], "timed", args.seed + 10 + i)
            for v in args.variants:
                for i in range(args.reps):
                    t128[n] = one(v, n, sd, "timed", args.seed + 20 + i)["ttft_s"]
        section(f"len{n}", lengths)

    # 3. default settings: the estimator's own selection (density ~1 on random weights), streamed
    ev = args.estimator_variant
    if ev not in engines:
        ev = "copy" if "copy" in engines else "none"
    for n in args.estimator_lengths:
        if fits(f"estimator-{n}", 4.0 * t128.get(n, 10.0)):
            section(f"estimator{n}", lambda n=n: one(ev, n, est, "timed", args.seed + 30))

    # 4. long prompts: streamed only (their KV cannot be resident); free the pull pool first
    del engines["none"]
    pool.kv = torch.empty(0, device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = max(t128.values(), default=4.0)
    for n in args.long:
        for variant, dfl in args.long_runs:
            sp = BenchSparse(dataclasses.replace(scfg, dense_first_layers=dfl), args.stream_density, args.seed)
            scale = n / max(args.lengths or [n])
            # (the 128K time scaled, the dense first layer ~0.25 s x scale^2)
            predicted = base * scale * 1.3 + sp.config.first_dense_layers(n) * 0.25 * scale ** 2
            if not fits(f"{variant}-{n}-dfl{dfl}", predicted):
                continue

            def long_run(n=n, variant=variant, sp=sp):
                sp.prepare(n, cfg.num_kv_heads, cfg.head_dim, device)
                if variant == "copy":
                    engines["copy"].producer.reserve(n)
                one(variant, n, sp, "timed", args.seed + 40,
                    note=f"receiver ring of {res['meta'].get('receiver', {}).get('ring_tokens')} tokens")
            section(f"long{n}-{variant}-dfl{dfl}", long_run)
            sp._fixed.clear()
    if receiver is not None:
        receiver.close()
    for e in {id(x): x for x in engines.values()}.values():
        e.producer.stop()
    res["summary"] = summarize(res)
    save()
    return res


def summarize(res: dict) -> dict:
    """Medians per (variant, tokens, mode, dense_first_layers) over timed runs; bars."""
    groups: dict[tuple, list] = {}
    for r in res["runs"]:
        if r["tag"] == "timed":
            groups.setdefault((r["variant"], r["tokens"], r["mode"], r["dense_first_layers"]), []).append(r)
    rows = []
    for (variant, n, mode, dfl), rs in groups.items():
        rows.append({"variant": variant, "tokens": n, "mode": mode, "dense_first_layers": dfl, "reps": len(rs),
                     "ttft_s": statistics.median(r["ttft_s"] for r in rs),
                     "peak_mem_gib": max((r.get("peak_mem_gib", 0.0) for r in rs)),
                     "kernel_density": rs[0].get("kernel_density"),
                     "estimator_density": rs[0]["estimator_density"]["mean"],
                     "write_s_median": rs[0].get("write_s_median")})
    base = {(r["tokens"], r["mode"]): r["ttft_s"] for r in rows if r["variant"] == "none"}
    for r in rows:
        b = base.get((r["tokens"], r["mode"]))
        if r["variant"] != "none" and b:
            r["over_no_transfer"] = r["ttft_s"] / b
        target = TARGET_128K_S if r["tokens"] == 131072 else TARGET_1M_S if r["tokens"] == 1 << 20 else None
        if target:
            r["meets_ttft_bar"] = r["ttft_s"] <= target
    return {"rows": rows}


def table(res: dict) -> str:
    lines = [f"{'variant':>10} {'tokens':>8} {'mode':>10} {'dfl':>3} {'TTFT s':>8} {'x none':>7} "
             f"{'peak GiB':>8} {'est.dens':>8} {'WRITE ms':>8}"]
    for r in res.get("summary", {}).get("rows", []):
        x = f"{r['over_no_transfer']:7.3f}" if "over_no_transfer" in r else f"{'-':>7}"
        ed = f"{r['estimator_density']:8.3f}" if r["estimator_density"] is not None else f"{'-':>8}"
        w = f"{r['write_s_median'] * 1e3:8.1f}" if r.get("write_s_median") is not None else f"{'-':>8}"
        lines.append(f"{r['variant']:>10} {r['tokens']:>8} {r['mode']:>10} {r['dense_first_layers']:>3} "
                     f"{r['ttft_s']:8.3f} {x} {r['peak_mem_gib']:8.1f} {ed} {w}")
    if res.get("check"):
        lines.append(f"check: {res['check']}")
    for k, v in res.get("errors", {}).items():
        lines.append(f"error {k}: {v[:300]}")
    for s in res.get("skipped", []):
        lines.append(f"skipped {s['run']} (predicted {s['predicted_s']:.0f} s)")
    return "\n".join(lines)


def compact(res: dict) -> str:
    """One short JSON line per timed run (what a console tail must carry if the JSON file is lost)."""
    keys = ("variant", "tokens", "mode", "dense_first_layers", "ttft_s", "queued_s", "peak_mem_gib",
            "activation_peak_gib", "kernel_density", "write_s_median", "write_s_max",
            "last_layer_posted_before_end_s", "receiver_done_after_first_token_s", "receiver")
    out = []
    for r in res["runs"]:
        if r["tag"] == "timed":
            row = {k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keys if k in r}
            row["est_density"] = r["estimator_density"]["mean"]
            out.append(json.dumps(row, separators=(",", ":")))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = bench_args(parse_args, argv, "bench e2e stream")
    if args is None:
        return 2
    res = run(args)
    print(compact(res))
    print(table(res))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

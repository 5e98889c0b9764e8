"""The receiving end of ``bench e2e stream``, in its own process: a ``PushReceiver`` (the decode-side
transport our vLLM connector wraps) with its own KV caches, driven by JSON lines on stdin and
answering JSON lines on stdout.

    python -m prefill_server.bench.stream_receiver '{"geometry": {...}, "secret": "...",
                                                     "blocks": 8192, "device": "cuda"}'
    stdin:  {"op": "register", "host": h, "port": p, "rid": r, "num_tokens": n}
            {"op": "dump", "rid": r, "num_tokens": n, "layers": [0, 31], "path": "/tmp/x.pt"}
            {"op": "quit"}
    stdout: {"event": "ready", "cache_gib": g} | {"event": "done", "rid": r, "t": ..., "layer_t": [...]}
            | {"event": "failed", "rid": r, "why": ...} | {"event": "dumped", "path": ...}

The caches hold ``blocks`` blocks per layer; a prompt needing more is written into them as a ring
(block i of the prompt -> cache block i % blocks): every byte still crosses, later ones overwrite
earlier ones. That is how one machine receives the 128 GiB of a 1M-token prompt of an 8B model.
Times are ``time.monotonic()`` (one clock for all processes of the machine): ``layer_t[l]`` is when
this process first saw layer l's "done" notification (polled every ~0.5 ms).
"""
from __future__ import annotations

import json
import queue
import sys
import threading
import time

import msgspec
import torch

from kv_transfer import wire
from kv_transfer.receiver import PushReceiver


def _say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _stdin_lines(q: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            q.put(json.loads(line))
    q.put({"op": "quit"})


def main() -> None:
    a = json.loads(sys.argv[1])
    g = msgspec.convert(a["geometry"], wire.Geometry)
    dtype = getattr(torch, g.dtype)
    nblk = int(a["blocks"])
    cache = torch.zeros(g.num_layers, nblk, g.num_kv_heads, g.block_size, 2 * g.head_dim, dtype=dtype,
                        device=a.get("device", "cpu"))
    caches = [cache[i] for i in range(g.num_layers)]  # [blocks, H, N, 2D] plain pages per layer
    recv = PushReceiver(caches, g, a["secret"].encode(), timeout_s=float(a.get("timeout_s", 900)))
    cmds: queue.Queue = queue.Queue()
    threading.Thread(target=_stdin_lines, args=(cmds,), daemon=True).start()
    _say(event="ready", cache_gib=cache.numel() * cache.element_size() / 2**30, pid=__import__("os").getpid())
    ring: dict[str, list[int]] = {}
    seen: dict[str, dict[int, float]] = {}
    try:
        while True:
            while not cmds.empty():
                c = cmds.get()
                if c["op"] == "quit":
                    return
                if c["op"] == "register":
                    n = -(-int(c["num_tokens"]) // g.block_size)
                    ring[c["rid"]] = [i % nblk for i in range(n)]
                    seen[c["rid"]] = {}
                    recv.register(c["host"], int(c["port"]), c["rid"], ring[c["rid"]], 0, int(c["num_tokens"]))
                elif c["op"] == "dump":
                    _dump(caches, ring[c["rid"]], int(c["num_tokens"]), c["layers"], c["path"], g)
                    _say(event="dumped", path=c["path"])
            res = recv.poll()
            now = time.monotonic()
            for rid, times in seen.items():  # per-layer arrival times (the receiver keeps the set)
                r = recv._recv.get(rid)
                for layer in (r.layers if r is not None else ()):
                    times.setdefault(layer, now)
            for rid in res.done:
                times = seen.pop(rid, {})
                _say(event="done", rid=rid, t=now, layer_t=[times.get(i, now) for i in range(g.num_layers)])
            for rid, why in res.failed.items():
                seen.pop(rid, None)
                _say(event="failed", rid=rid, why=why)
            time.sleep(0.0005)
    finally:
        recv.close()


def _dump(caches, block_ids, n, layers, path, g) -> None:
    """K, V [n, H, D] of the given layers as this process received them, saved on the CPU."""
    out = {}
    idx = torch.tensor(block_ids[: -(-n // g.block_size)], device=caches[0].device)
    for layer in layers:
        pages = caches[layer].index_select(0, idx)  # [b, H, N, 2D]
        flat = pages.permute(0, 2, 1, 3).reshape(-1, g.num_kv_heads, 2 * g.head_dim)[:n]
        out[int(layer)] = (flat[..., : g.head_dim].cpu(), flat[..., g.head_dim:].cpu())
    torch.save(out, path)


if __name__ == "__main__":
    main()

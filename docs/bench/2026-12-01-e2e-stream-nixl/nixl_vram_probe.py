"""Does NIXL move CUDA memory between two processes here (what the streaming bench needs)? This
process and a child each allocate 64 MiB with torch on the GPU and register it with their own NIXL
agent; this one WRITEs its bytes into the child's (8 descriptors of 8 MiB) and the two compare
SHA-256 digests. Prints one line `PROBE {json}`: ok, the stage reached, the error if any, the NIXL
module loaded, the environment variables that matter. Run by docs/bench/2026-12-01-e2e-stream-nixl/e2e_stream_nixl.sh once
per environment. PROBE_DEVICE=cpu: the same over DRAM (a smoke run anywhere). PROBE_MB (64) sizes
the buffers, PROBE_REPS (1) repeats the WRITE (each timed: the first includes UCX's connection and
memory-handle setup), PROBE_DESCS (8) splits it.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time

KEYS = ("NIXL_CUDA_MAJOR", "UCX_MEMTYPE_CACHE", "UCX_TLS", "UCX_MODULE_DIR", "PYTORCH_CUDA_ALLOC_CONF")
N = int(os.environ.get("PROBE_MB", "64")) << 20


def _buf(fill: bool):
    import torch
    dev = os.environ.get("PROBE_DEVICE", "cuda")
    if fill:
        return torch.randint(0, 255, (N,), dtype=torch.uint8, device=dev)
    return torch.zeros(N, dtype=torch.uint8, device=dev)


def _digest(buf) -> str:
    import torch
    if buf.is_cuda:
        torch.cuda.synchronize()
    return hashlib.sha256(buf.cpu().numpy().tobytes()).hexdigest()


def _answer(proc) -> dict:
    """The child's next JSON line (UCX logs to stdout too: other lines are skipped)."""
    for line in proc.stdout:
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return {"error": "receiver: no answer"}


def child() -> None:
    """The receiving process: register a zeroed buffer, print its metadata, digest on request."""
    from kv_transfer.nixl import NixlAgent
    try:
        buf = _buf(False)
        agent = NixlAgent("probe-b", progress_thread=True)  # the passive side progresses by itself
        agent.register(buf)
        print(json.dumps({"meta": base64.b64encode(agent.metadata()).decode(), "addr": buf.data_ptr()}), flush=True)
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"error": f"receiver: {type(e).__name__}: {e}"[:400]}), flush=True)
        return
    for line in sys.stdin:
        if line.strip() == "digest":
            print(json.dumps({"digest": _digest(buf)}), flush=True)
        else:
            break
    agent.close()


def main() -> int:
    out = {"ok": False, "stage": "import", "env": {k: os.environ.get(k) for k in KEYS}}
    t0 = time.perf_counter()
    proc = None
    try:
        import numpy as np

        from kv_transfer.nixl import NixlAgent
        import nixl._api as api
        out["nixl"] = getattr(api.nixl_agent, "__module__", "?")
        mem = "DRAM" if os.environ.get("PROBE_DEVICE") == "cpu" else "VRAM"
        out["stage"] = "register"
        a_buf = _buf(True)
        a = NixlAgent("probe-a")
        a.register(a_buf)
        out["stage"] = "receiver"
        proc = subprocess.Popen([sys.executable, __file__, "--child"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        info = _answer(proc)
        if "error" in info:
            raise RuntimeError(info["error"])
        out["stage"] = "handshake"
        peer = a.add_remote(base64.b64decode(info["meta"]))
        out["stage"] = "write"
        nd = int(os.environ.get("PROBE_DESCS", "8"))
        step = N // nd
        src = np.array([(a_buf.data_ptr() + i * step, step, 0) for i in range(nd)], dtype=np.uint64)
        dst = np.array([(info["addr"] + i * step, step, 0) for i in range(nd)], dtype=np.uint64)
        out["mb"], out["descs"], out["write_ms"] = N >> 20, nd, []
        for _ in range(int(os.environ.get("PROBE_REPS", "1"))):
            t = time.perf_counter()
            a.transfer("WRITE", src, dst, peer, mem, mem, notif=b"probe", timeout_s=60)
            out["write_ms"].append(round((time.perf_counter() - t) * 1e3, 3))
        out["gb_per_s_last"] = round(N / out["write_ms"][-1] / 1e6, 2)
        out["stage"] = "compare"
        proc.stdin.write("digest\n")
        proc.stdin.flush()
        got = _answer(proc).get("digest")
        out["ok"] = got == _digest(a_buf)
        a.close()
    except Exception as e:  # noqa: BLE001 - the point is to report it
        out["error"] = f"{type(e).__name__}: {e}"[:400]
    finally:
        if proc is not None:
            try:
                proc.stdin.write("quit\n")
                proc.stdin.flush()
                proc.wait(timeout=20)
            except Exception:  # noqa: BLE001
                proc.kill()
    out["s"] = round(time.perf_counter() - t0, 2)
    print("PROBE " + json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        child()
        sys.exit(0)
    sys.exit(main())

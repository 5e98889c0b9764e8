"""The transfer variants of ``bench e2e stream`` (see its docstring): producers that stand in for
the engine's ``PushProducer`` (``NullPush``: the push path sending nothing; ``CopyPush``: the same
bytes copied to pinned host memory on a side CUDA stream), and ``ReceiverProc``, the receiving
``PushReceiver`` in a subprocess (``bench/stream_receiver.py``). (The prototype of posting off the
forward's thread that lived here is now ``PushProducer`` itself; ``Reaper``, the experiment that
showed NIXL completes a WRITE only when its state is checked, is now the producer's own polling.)
"""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

import torch

from kv_transfer.base import Route, StreamProducer
from prefill_server.engine.kv_pool import KVPool
from prefill_server.engine.scheduler import Scheduler

SECRET = "bench-stream-secret-0123456789"


# ---- producers for the variants without NIXL ----
class NullPush(StreamProducer):
    """The push path with nothing sent: ``layer_done`` waits for the layer's K/V (the event) as the
    engine's producer does, and returns."""

    routes = frozenset({Route.STREAM})

    def __init__(self):
        self._live: set[str] = set()
        self.last_layer_times: dict[str, list] = {}

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def expect(self, request_id: str, num_tokens: int, bootstrap_room: int | None = None) -> dict:
        self._live.add(request_id)
        return {"bench": {"request_id": request_id}}

    def is_ready(self, request_id: str) -> bool:
        return request_id in self._live

    def wants_pull(self, request_id: str) -> bool:
        return False

    def overdue(self, request_id: str, now=None):
        return None

    def layer_done(self, request_id, layer, src_pages, ready_event=None) -> None:
        if ready_event is not None:
            ready_event.synchronize()

    def wait_layer(self, request_id, layer, stop=None) -> None: ...

    def finish(self, request_id, timeout_s=None, stop=None, *, first_token=None, logprobs=None, cached_tokens=0) -> dict:
        self._live.discard(request_id)
        return {}

    def abort(self, request_id, reason: str = "", on_idle=None) -> bool:
        live = request_id in self._live
        self._live.discard(request_id)
        if on_idle is not None:  # (nothing is ever in flight here)
            on_idle()
        return live


class CopyPush(NullPush):
    """Each layer's staging pages copied to pinned host memory on a side CUDA stream (it waits on
    the layer's event; the forward's thread never waits): the floor of a hidden transfer."""

    def __init__(self, pool: KVPool):
        super().__init__()
        self.pool = pool
        self.stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self._idx: dict[int, torch.Tensor] = {}
        self._host: dict[int, torch.Tensor] = {}
        self._done: dict[int, object] = {}

    def reserve(self, num_tokens: int) -> None:
        """Allocate the pinned buffers for a prompt of ``num_tokens`` before the timed runs (runs 1-2
        allocated them inside the first timed 128K run: +0.35-0.39 s once)."""
        n = self.pool.blocks_needed(num_tokens)
        flat = self.pool.kv.view(-1, *self.pool.kv.shape[2:])
        for slot in range(Scheduler.STREAM_SLOTS):
            if slot not in self._host or self._host[slot].shape[0] < n:
                self._host[slot] = torch.empty((n, *flat.shape[1:]), dtype=flat.dtype,
                                               pin_memory=self.stream is not None)

    def layer_done(self, request_id, layer, src_pages, ready_event=None) -> None:
        key = id(src_pages)
        if key not in self._idx:
            self._idx[key] = torch.tensor(list(src_pages), dtype=torch.long, device=self.pool.device)
        idx = self._idx[key]
        flat = self.pool.kv.view(-1, *self.pool.kv.shape[2:])
        slot = layer % Scheduler.STREAM_SLOTS
        n = idx.numel()
        self.reserve(n * self.pool.block_size)
        if self.stream is None:
            self._host[slot][:n].copy_(flat.index_select(0, idx))
            return
        with torch.cuda.stream(self.stream):
            if ready_event is not None:
                self.stream.wait_event(ready_event)
            self._host[slot][:n].copy_(flat.index_select(0, idx), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._done[layer] = ev

    def wait_layer(self, request_id, layer, stop=None) -> None:
        ev = self._done.pop(layer, None)
        if ev is not None:
            ev.synchronize()

    def finish(self, request_id, timeout_s=None, stop=None, *, first_token=None, logprobs=None, cached_tokens=0) -> dict:
        for layer in list(self._done):
            self.wait_layer(request_id, layer)
        self._idx.clear()
        return super().finish(request_id)


# ---- the receiver process ----
class ReceiverProc:
    """``bench/stream_receiver.py`` in a subprocess; JSON lines both ways."""

    def __init__(self, geometry, blocks: int, device: str, timeout_s: float = 180.0):
        import msgspec
        arg = json.dumps({"geometry": msgspec.to_builtins(geometry), "secret": SECRET, "blocks": blocks,
                          "device": device})
        self.p = subprocess.Popen([sys.executable, "-m", "prefill_server.bench.stream_receiver", arg],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._events: queue.Queue = queue.Queue()
        self._held: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self.next(lambda e: e["event"] == "ready", timeout_s)

    def _read(self) -> None:
        for line in self.p.stdout:
            try:
                self._events.put(json.loads(line))
            except json.JSONDecodeError:
                print("[receiver]", line.rstrip(), file=sys.stderr, flush=True)
        self._events.put({"event": "exited", "rc": self.p.wait()})

    def next(self, pred, timeout_s: float) -> dict:
        for i, e in enumerate(self._held):
            if pred(e):
                return self._held.pop(i)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                e = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"receiver: no matching event within {timeout_s} s") from None
            if e["event"] == "exited":
                raise RuntimeError(f"receiver process exited (rc {e['rc']})")
            if pred(e):
                return e
            self._held.append(e)

    def send(self, **kw) -> None:
        self.p.stdin.write(json.dumps(kw) + "\n")
        self.p.stdin.flush()

    def close(self) -> None:
        try:
            self.send(op="quit")
            self.p.wait(timeout=20)
        except Exception:  # noqa: BLE001
            self.p.kill()

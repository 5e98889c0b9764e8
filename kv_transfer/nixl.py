"""A thin wrapper over NIXL's Python agent (``nixl._api.nixl_agent``, nixl 1.5).

What it adds: one agent per producer with the UCX backend, the KV pool registered ONCE as one
region (never per request), descriptor helpers that coalesce runs of contiguous blocks, transfers
that wait with a timeout (sleeping between polls, never spinning), and a shutdown that releases
handles, forgets remote agents and deregisters memory in that order.

NIXL facts this relies on (nixl 1.5.1):
- ``get_new_notifs()`` returns ``{remote_agent_name: [bytes, ...]}`` with only the notifications
  that arrived since the last call (``update_notifs`` would accumulate them instead).
- ``get_agent_metadata()`` is the blob a peer passes to ``add_remote_agent``; it lists the
  registered regions, so it must be taken after ``register``.
- A peer can READ/WRITE any sub-range of a registered region; the progress thread (on by default)
  services one-sided operations and notifications while no Python code runs.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch


log = logging.getLogger(__name__)

_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.01


class NixlError(RuntimeError):
    """NIXL is missing, a backend is unavailable, or a transfer failed or timed out. (This module is
    shared by both sides, the decode's connector included, so it raises its own error: the prefill
    side reports it as a transfer failure.)"""


_BACKENDS = ("nixl_cu13", "nixl_cu12")  # NIXL's builds, as its ``nixl`` meta package picks without CUDA


def import_nixl() -> Any:
    """The ``nixl._api`` module, or a ``NixlError`` saying what to install. Without the ``nixl`` meta
    package (it requires every CUDA build, so it is not a dependency: ``pip install prefill-server``
    brings ``nixl-cu12`` alone), the installed build's own ``_api``."""
    import importlib

    try:
        api = importlib.import_module("nixl._api")
    except ImportError as e:
        if e.name not in ("nixl", "nixl._api"):
            raise NixlError(f"NIXL is not importable ({e}); install nixl-cu12==1.5.1") from e
        for name in _BACKENDS:
            try:
                api = importlib.import_module(f"{name}._api")
                break
            except ModuleNotFoundError as e2:
                if e2.name != name:
                    raise NixlError(f"NIXL is not importable ({e2}); install nixl-cu12==1.5.1") from e2
        else:
            raise NixlError("NIXL is not importable (none of nixl, nixl_cu13, nixl_cu12); "
                            "install nixl-cu12==1.5.1") from e
    _nixl_logs_to_stderr()
    return api


def _nixl_logs_to_stderr() -> None:
    """NIXL's logger writes to stdout; a server's stdout is for its own output (the address line)."""
    import sys

    for h in logging.getLogger("nixl").handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)


def mem_type_of(tensor: torch.Tensor) -> str:
    return "DRAM" if tensor.device.type == "cpu" else "VRAM"


def device_id_of(tensor: torch.Tensor) -> int:
    return 0 if tensor.device.type == "cpu" else int(tensor.device.index or 0)


def memory_ranges(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Disjoint (address, bytes) ranges covering every tensor's span, merged where they touch or
    overlap (views of one storage are registered once)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
                    * t.element_size()) for t in tensors)
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in out]


class NixlAgent:
    """One NIXL agent. Not thread-safe by itself: use it from one thread at a time (a producer's
    service thread), or guard it with a lock."""

    def __init__(self, name: str, backends: Iterable[str] = ("UCX",), num_threads: int = 0,
                 progress_thread: bool = False):
        api = import_nixl()
        self.name = name
        self.backends = list(backends)
        cfg = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=self.backends,
                                    num_threads=num_threads)
        self._agent = api.nixl_agent(name, cfg)
        missing = [b for b in self.backends if b not in self._agent.backends]
        if missing:
            raise NixlError(f"NIXL backend(s) {missing} unavailable; plugins found: "
                                f"{self._agent.get_plugin_list()}")
        self._reg_descs: Any = None
        self._registered: torch.Tensor | None = None
        self._remotes: set[str] = set()
        self._closed = False

    # ---- memory ----
    def register(self, tensor: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Register the memory the tensor(s) span, one region per disjoint range. Once per agent: a
        pool is one tensor; a vLLM decode's cache is one view per layer, possibly strided (a
        permuted page layout) or interleaved with the other layers' (block-outer layouts)."""
        if self._registered is not None:
            raise RuntimeError("NixlAgent.register: memory is already registered (register once)")
        tensors = [tensor] if isinstance(tensor, torch.Tensor) else list(tensor)
        if not tensors or any(t.numel() == 0 or min(t.stride()) < 0 for t in tensors):
            raise ValueError("NixlAgent.register: give one or more non-empty tensors with non-negative strides")
        mem = mem_type_of(tensors[0])
        region = [(ptr, n, device_id_of(tensors[0]), "") for ptr, n in memory_ranges(tensors)]
        descs = self._agent.get_reg_descs(region, mem)
        self._agent.register_memory(descs, backends=self.backends)
        self._reg_descs, self._registered = descs, tensors[0]
        log.debug("nixl %s registered %d region(s), %d bytes (%s)", self.name, len(region),
                  sum(r[1] for r in region), mem)

    @property
    def registered(self) -> torch.Tensor | None:
        return self._registered

    def metadata(self) -> bytes:
        """Full agent metadata (connection info and registered regions), for a peer's
        ``add_remote_agent``."""
        return self._agent.get_agent_metadata()

    # ---- peers and notifications ----
    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode()
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        if name in self._remotes:
            self._remotes.discard(name)
            self._agent.remove_remote_agent(name)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (sender agent, message)."""
        out: list[tuple[str, bytes]] = []
        for agent, msgs in self._agent.get_new_notifs().items():
            out.extend((agent, m) for m in msgs)
        return out

    def send_notif(self, remote: str, msg: bytes) -> None:
        self._agent.send_notif(remote, msg)

    # ---- transfers (initiator side: our push mode, and tests that play the decode) ----
    def transfer(self, op: str, local_descs: np.ndarray, remote_descs: np.ndarray, remote: str,
                 mem_type: str = "DRAM", remote_mem_type: str | None = None, notif: bytes = b"",
                 timeout_s: float = 30.0) -> int:
        """Run one READ or WRITE between equal-length Nx3 descriptor arrays and wait for it.
        Returns the bytes moved. Raises ``NixlError`` on error or timeout (the handle is
        released either way)."""
        if op not in ("READ", "WRITE"):
            raise ValueError(f"op must be READ or WRITE, not {op!r}")
        local = self._agent.get_xfer_descs(local_descs, mem_type)
        remote_list = self._agent.get_xfer_descs(remote_descs, remote_mem_type or mem_type)
        handle = self._agent.initialize_xfer(op, local, remote_list, remote, notif)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            delay = _POLL_MIN_S
            while state == "PROC":
                if time.monotonic() >= deadline:
                    raise NixlError(f"NIXL {op} to {remote} timed out after {timeout_s} s")
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise NixlError(f"NIXL {op} to {remote} failed: {state}")
        finally:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - an active transfer cannot be released; log only
                log.exception("nixl %s: could not release a transfer handle", self.name)
        return int(np.asarray(local_descs, dtype=np.uint64).reshape(-1, 3)[:, 1].sum())

    # ---- asynchronous transfers (push mode: one per layer, overlapped with compute) ----
    def post(self, op: str, local_descs: np.ndarray, remote_descs: np.ndarray, remote: str,
             mem_type: str = "DRAM", remote_mem_type: str | None = None, notif: bytes = b"") -> Any:
        """Start a READ/WRITE and return its handle at once; ``poll`` it, then ``release`` it.
        The notification (if any) reaches the peer after the data."""
        if op not in ("READ", "WRITE"):
            raise ValueError(f"op must be READ or WRITE, not {op!r}")
        local = self._agent.get_xfer_descs(local_descs, mem_type)
        remote_list = self._agent.get_xfer_descs(remote_descs, remote_mem_type or mem_type)
        handle = self._agent.initialize_xfer(op, local, remote_list, remote, notif)
        state = self._agent.transfer(handle)
        if state not in ("PROC", "DONE"):
            self.release(handle)
            raise NixlError(f"NIXL {op} to {remote} could not start: {state}")
        return handle

    def poll(self, handle: Any) -> str:
        """"PROC" (in flight), "DONE", or an error state ("ERR: ..."; NIXL raises for some,
        e.g. NIXL_ERR_REMOTE_DISCONNECT when the peer died)."""
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001
            return f"ERR: {type(e).__name__}: {e}"

    def release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - an active transfer cannot be released; log only
            log.exception("nixl %s: could not release a transfer handle", self.name)

    # ---- shutdown ----
    def close(self) -> None:
        """Forget peers, deregister memory. Idempotent; the agent object is unusable after."""
        if self._closed:
            return
        self._closed = True
        for name in list(self._remotes):
            try:
                self.remove_remote(name)
            except Exception:  # noqa: BLE001
                log.debug("nixl %s: remove_remote(%s) failed", self.name, name, exc_info=True)
        if self._reg_descs is not None:
            try:
                self._agent.deregister_memory(self._reg_descs, backends=self.backends)
            except Exception:  # noqa: BLE001
                log.exception("nixl %s: deregister_memory failed", self.name)
            self._reg_descs, self._registered = None, None

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The ZMQ control plane with SGLang decodes: our PULL socket (their registrations, transfer infos
and aborts arrive there; ``bootstrap_info`` advertises it) and one PUSH socket per decode endpoint
(our KV_STATUS and ABORT_ACK go there).

Never blocks on a decode: sends are non-blocking (a decode that is gone, or not reading, loses the
message; its own timeouts end the room, as with SGLang's prefill) and the endpoint cache is bounded.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import zmq

log = logging.getLogger(__name__)


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


class ControlSockets:
    """``bind_host``:``port`` (0: a free port; ``port`` then says which) for the PULL socket. The
    PULL socket belongs to the producer's service thread; ``send`` may be called from any thread."""

    MAX_FRAMES = 64  # no SGLang message has more than 25
    MAX_MESSAGE_BYTES = 256 << 20  # (a registration carries NIXL metadata: a few MB at most)

    def __init__(self, bind_host: str, port: int = 0, max_endpoints: int = 1024):
        self._ctx: Any = zmq.Context()
        self.pull: Any = None
        self._push: OrderedDict[str, Any] = OrderedDict()
        self._send_lock = threading.Lock()
        self.max_endpoints = max_endpoints
        self.dropped_total = 0  # messages to decodes that could not be queued
        try:
            self.pull = self._ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.LINGER, 0)
            self.pull.setsockopt(zmq.MAXMSGSIZE, self.MAX_MESSAGE_BYTES)
            if ":" in bind_host:
                self.pull.setsockopt(zmq.IPV6, 1)
            addr = _tcp(bind_host, 0).rsplit(":", 1)[0]
            if port:
                self.pull.bind(f"{addr}:{port}")
                self.port = port
            else:
                self.port = self.pull.bind_to_random_port(addr)
        except Exception:
            self.close()
            raise

    def poller(self) -> zmq.Poller:
        p = zmq.Poller()
        p.register(self.pull, zmq.POLLIN)
        return p

    def receive(self) -> list[bytes] | None:
        """One waiting message's frames (None if none is waiting, or it had too many frames)."""
        try:
            frames = self.pull.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        if len(frames) > self.MAX_FRAMES:
            log.warning("sglang control: dropped a %d-frame message", len(frames))
            return None
        return frames

    def send(self, host: str, port: int, frames: list[bytes]) -> bool:
        """Queue ``frames`` for the decode at host:port; False if it could not be queued."""
        endpoint = _tcp(host, port)
        with self._send_lock:
            if self._ctx is None:
                return False
            try:
                sock = self._push.get(endpoint)
                if sock is None:
                    sock = self._connect(endpoint, ":" in host)
                self._push.move_to_end(endpoint)
                sock.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.ZMQError as e:
                self.dropped_total += 1
                log.warning("sglang control: could not queue a %r message for %s: %s", frames[0][:16], endpoint, e)
                return False

    def _connect(self, endpoint: str, ipv6: bool) -> Any:  # (send lock held)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        self._push[endpoint] = sock
        while len(self._push) > self.max_endpoints:
            _, old = self._push.popitem(last=False)
            old.close(linger=0)
        return sock

    def close(self) -> None:
        with self._send_lock:
            for sock in self._push.values():
                sock.close(linger=0)
            self._push.clear()
            if self.pull is not None:
                self.pull.close(linger=0)
                self.pull = None
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None

"""A ZMQ ROUTER socket serving REQ peers: the side channels of both producers (vLLM 0.32's
get-meta handshake, and our signed push protocol) bind, receive and close through this one class.
One owner thread uses it (the producer's service thread), as ZMQ sockets require."""
from __future__ import annotations

import logging
from typing import Any

import zmq

log = logging.getLogger(__name__)


class RouterSocket:
    """``bind_host``:``port`` (0 = a free port, then ``port`` says which); IPv6 hosts work."""

    def __init__(self, bind_host: str, port: int = 0):
        self._context: Any = zmq.Context()
        self.sock: Any = None
        try:
            self.sock = self._context.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            if ":" in bind_host:
                self.sock.setsockopt(zmq.IPV6, 1)
            host = f"[{bind_host}]" if ":" in bind_host and not bind_host.startswith("[") else bind_host
            if port:
                self.sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        except Exception:
            self.close()
            raise

    def poller(self) -> zmq.Poller:
        p = zmq.Poller()
        p.register(self.sock, zmq.POLLIN)
        return p

    def recv_request(self) -> tuple[bytes, bytes] | None:
        """(peer identity, body) of one waiting REQ message, or None for a malformed one (logged)."""
        frames = self.sock.recv_multipart(zmq.NOBLOCK)
        if len(frames) == 3 and frames[1] == b"":
            return frames[0], frames[2]
        log.warning("side channel: ignored a %d-frame message (not from a REQ socket)", len(frames))
        return None

    def reply(self, identity: bytes, *frames: bytes) -> None:
        self.sock.send_multipart((identity, b"", *frames))

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self._context is not None:
            self._context.term()
            self._context = None

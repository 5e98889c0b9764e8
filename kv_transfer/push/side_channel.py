"""The push side channel: a ZMQ ROUTER socket that takes our signed messages (``kv_transfer.wire``)
from decodes' connectors, and answers them. Hygiene lives here, once: a message that does not
decode, speaks another protocol version, fails authentication or replays a nonce is refused (a
stranger gets an unsigned refusal that carries nothing else); the rest reaches the producer's
handlers already verified. Answers to a known peer are signed. ``register_refusal`` checks what a
verified Register asks of our pool."""
from __future__ import annotations

import logging

import msgspec

from kv_transfer import layout, wire
from kv_transfer.base import KVPages
from kv_transfer.router_socket import RouterSocket

log = logging.getLogger(__name__)


class SignedSideChannel:
    def __init__(self, secret: bytes, bind_host: str, port: int = 0):
        self.secret = secret
        self.router = RouterSocket(bind_host, port)
        self.port = self.router.port
        self._replay = wire.ReplayGuard()
        self.refused_total = 0

    def poller(self):
        return self.router.poller()

    def receive(self) -> tuple[bytes, wire.Message] | None:
        """One waiting message, verified: (peer identity, message), or None when it was refused
        (or was not a REQ peer's)."""
        got = self.router.recv_request()
        if got is None:
            return None
        identity, body = got
        try:
            msg = wire.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.refuse(identity, "", b"", f"malformed message: {e}", signed=False)
            return None
        if msg.version != wire.PROTOCOL_VERSION:  # first: another version's MAC would not match
            self.refuse(identity, "", b"", f"protocol version {msg.version} not supported (this server "
                        f"speaks {wire.PROTOCOL_VERSION}); upgrade the side that is behind", signed=False)
            return None
        if isinstance(msg, (wire.Ack, wire.Offer)) or not wire.verify(self.secret, msg):
            log.warning("side channel: refused a message that failed authentication")
            self.refuse(identity, "", b"", "authentication failed", signed=False)
            return None
        if why := self._replay.check(msg.nonce, msg.timestamp):
            self.refuse(identity, msg.request_id, msg.nonce, why, signed=True)
            return None
        return identity, msg

    def reply(self, identity: bytes, msg: wire.Message) -> None:
        """Send ``msg`` signed."""
        self.router.reply(identity, wire.encode(wire.sign(self.secret, msg)))

    def accept(self, identity: bytes, request_id: str, nonce: bytes, **fields) -> None:
        self.reply(identity, wire.Ack(version=wire.PROTOCOL_VERSION, request_id=request_id, accepted=True,
                                      nonce=nonce, **fields))

    def refuse(self, identity: bytes, request_id: str, nonce: bytes, error: str, signed: bool) -> None:
        self.refused_total += 1
        ack = wire.Ack(version=wire.PROTOCOL_VERSION, request_id=request_id, accepted=False, error=error,
                       nonce=nonce)
        if signed:
            self.reply(identity, ack)
        else:  # a stranger: an unsigned refusal and nothing else
            self.router.reply(identity, wire.encode(ack))

    def close(self) -> None:
        self.router.close()


def register_refusal(reg: wire.Register, geometry: wire.Geometry, pool: KVPages) -> str | None:
    """Why a verified Register's destination cannot be written from this pool, or None: its KV
    geometry, layers, blocks, page layout, memory type and transfer mode."""
    if diffs := geometry.mismatches(reg.geometry):
        return "incompatible KV layout: " + "; ".join(diffs)
    g = reg.geometry
    needed = pool.blocks_needed(reg.num_tokens)
    if len(reg.layer_addrs) != g.num_layers:
        return f"{len(reg.layer_addrs)} layer addresses for {g.num_layers} layers"
    if len(reg.block_ids) < needed or not 0 <= reg.first_token < reg.num_tokens:
        return (f"{reg.num_tokens} tokens need {needed} destination blocks, got "
                f"{len(reg.block_ids)} (first token {reg.first_token})")
    try:
        layout.of_wire(g.page_layout, reg.layer_addrs, reg.block_stride, reg.head_stride, reg.token_stride, g)
    except ValueError as e:
        return f"bad destination: {e}"
    if reg.mem_type not in ("DRAM", "VRAM") or reg.transfer_mode not in wire.TRANSFER_MODES:
        return f"bad destination: memory type {reg.mem_type!r}, transfer mode {reg.transfer_mode!r}"
    return None

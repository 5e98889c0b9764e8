"""Seeded fuzz of the prefill's push/pull side channel (connector mode, issue 3): ~470 malformed,
unauthenticated, replayed and authenticated-but-nonsensical messages over a real ZMQ socket.
Each must be answered (a REQ peer never hangs) with a refusal that names the problem, nothing may
crash the service thread, and a request waiting for its decode must survive every bad Register
aimed at it: afterwards the real receiver registers it, its KV streams, and both pools are empty.
"""
from __future__ import annotations

import random
import time

import msgspec
import zmq

from kv_transfer import wire
from kv_transfer.base import Route
from prefill_server.engine.types import PrefillRequest
from test_push import SECRET, loaded, setup  # noqa: F401 - (loaded, setup: fixtures)

SEED = 20261201


class Channel:
    """One REQ socket per message (a REQ whose reply never came cannot send again)."""

    def __init__(self, port: int):
        self.ctx, self.port = zmq.Context(), port

    def ask(self, body: bytes, timeout_s: float = 3.0) -> wire.Ack | None:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        try:
            sock.connect(f"tcp://127.0.0.1:{self.port}")
            sock.send(body)
            try:
                return wire.decode(sock.recv())
            except zmq.Again:
                return None
        finally:
            sock.close(linger=0)

    def send_frames(self, frames: list[bytes]) -> None:
        """A DEALER sends what a REQ cannot: any number of frames, no empty delimiter."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        sock.send_multipart(frames)
        time.sleep(0.01)
        sock.close(linger=0)

    def close(self) -> None:
        self.ctx.term()


def signed(msg, secret: bytes = SECRET):
    return wire.sign(secret, msgspec.structs.replace(msg, nonce=wire.new_nonce(), timestamp=time.time()))


def bad_registers(reg: wire.Register, rng: random.Random) -> list[tuple[str, wire.Register]]:
    """Authenticated Registers for a waiting request, each wrong in one way the prefill must catch."""
    g, n = reg.geometry, reg.num_tokens
    rep = msgspec.structs.replace
    out = [
        ("no layers", rep(reg, layer_addrs=[])),
        ("one layer too many", rep(reg, layer_addrs=reg.layer_addrs + [reg.layer_addrs[-1] + 1])),
        ("too few blocks", rep(reg, block_ids=reg.block_ids[:-1])),
        ("first token past the end", rep(reg, first_token=n)),
        ("negative first token", rep(reg, first_token=-1)),
        ("other token count", rep(reg, num_tokens=n + 1, block_ids=reg.block_ids + [99])),
        ("zero tokens", rep(reg, num_tokens=0)),
        ("negative tokens", rep(reg, num_tokens=-5)),
        ("2**62 tokens", rep(reg, num_tokens=2**62)),
        ("memory type", rep(reg, mem_type="HBM")),
        ("transfer mode", rep(reg, transfer_mode="teleport")),
        ("layout", rep(reg, geometry=rep(g, page_layout="XYZ"))),
        ("negative block stride", rep(reg, block_stride=-reg.block_stride)),
        ("zero block stride", rep(reg, block_stride=0)),
        ("huge head stride", rep(reg, head_stride=2**60)),
        ("model", rep(reg, geometry=rep(g, model_fingerprint="someone-else"))),
        ("dtype", rep(reg, geometry=rep(g, dtype="int8"))),
        ("block size", rep(reg, geometry=rep(g, block_size=0))),
        ("layers", rep(reg, geometry=rep(g, num_layers=-1))),
        ("garbage NIXL metadata", rep(reg, agent_name="stranger-agent", agent_metadata=rng.randbytes(300))),
        ("empty NIXL metadata", rep(reg, agent_name="stranger-agent-2", agent_metadata=b"")),
        ("unknown request", rep(reg, request_id="nobody-asked")),
    ]
    for i in range(20):  # random field values of the right types
        out.append((f"random {i}", rep(reg, block_ids=[rng.randint(-2**63, 2**63 - 1) for _ in range(rng.randint(0, 40))],
                                       first_token=rng.randint(-10, n + 10), num_tokens=rng.choice([n, n + 1, 0, -1]),
                                       layer_addrs=[rng.randint(0, 2**64 - 1)] * rng.randint(0, 3))))
    return out


def authentic(body: bytes) -> bool:
    """Does ``body`` decode to a decode-side message our secret signed? (A flipped byte can leave the meaning
    alone, e.g. in the key of a field whose value is its default: msgspec skips unknown keys.)"""
    try:
        msg = wire.decode(body)
        return isinstance(msg, (wire.Register, wire.Cancel, wire.Fetch)) and wire.verify(SECRET, msg)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


def malformed(reg: wire.Register, rng: random.Random) -> list[tuple[str, bytes]]:
    """Junk, foreign or unsigned messages, and mutations of one signed Register for ``reg``'s id
    (a request not waiting here: even one that still verifies is refused)."""
    enc = msgspec.msgpack.encode
    good = wire.encode(signed(msgspec.structs.replace(reg, request_id="ghost")))
    out: list[tuple[str, bytes]] = [("empty", b""), ("one byte", b"\x00"), ("nil", enc(None)),
                                    ("list", enc([1, 2, 3])), ("unknown type", enc({"type": "launch"})),
                                    ("no type", enc({"version": wire.PROTOCOL_VERSION})),
                                    ("wrong secret", wire.encode(signed(reg, b"not-the-secret-xxxxxxxx"))),
                                    ("no mac", wire.encode(msgspec.structs.replace(signed(reg), mac=b""))),
                                    ("an Ack", wire.encode(wire.sign(SECRET, wire.Ack(version=wire.PROTOCOL_VERSION,
                                                                                      request_id="x", accepted=True)))),
                                    ("old version", wire.encode(msgspec.structs.replace(reg, version=1))),
                                    ("deep nesting", b"\x91" * 100_000 + b"\xc0"),
                                    ("64 MiB string header", b"\xdb\x04\x00\x00\x00abc")]
    as_dict = msgspec.to_builtins(signed(reg))
    for field, value in (("request_id", 7), ("block_ids", "1,2"), ("num_tokens", 2**64 - 1), ("first_token", 1.5),
                         ("timestamp", "now"), ("nonce", 5), ("geometry", []), ("layer_addrs", [-1.0]),
                         ("version", None), ("mac", "abc")):
        out.append((f"{field}={value!r}", enc(dict(as_dict, **{field: value}))))
    for i in range(200):
        out.append((f"random bytes {i}", rng.randbytes(rng.choice([1, 7, 64, 500, 4000]))))
    for i in range(200):  # a real message with bytes flipped, cut or spliced
        b = bytearray(good)
        how = rng.choice(["flip", "cut", "splice"])
        if how == "flip":
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif how == "cut":
            b = b[:rng.randrange(len(b))]
        else:
            at = rng.randrange(len(b))
            b = b[:at] + rng.randbytes(rng.randint(1, 50)) + b[at:]
        out.append((f"{how} {i}", bytes(b)))
    return out


def test_the_side_channel_refuses_every_bad_message_and_keeps_the_waiting_request(setup, loaded):
    s, rng = setup, random.Random(SEED)
    ids = loaded.tokenizer.encode("A request that waits for its decode while strangers knock. " * 4)
    fut, _ = s.engine.start_stream(PrefillRequest("victim", tuple(ids), route=Route.STREAM))
    reg = s.receiver.register_message("victim", list(range(-(-len(ids) // 16))), 0, len(ids))
    ch = Channel(s.producer.port)
    try:
        refused0, asked = s.producer.refused_total, 0
        for name, body in malformed(reg, rng):
            ack, asked = ch.ask(body), asked + 1
            assert ack is not None, f"{name}: no answer"
            assert isinstance(ack, wire.Ack) and not ack.accepted and ack.error, f"{name}: {ack}"
            if authentic(body):  # ("ghost" is not waiting here, or a replay): a signed refusal
                assert wire.verify(SECRET, ack) and ack.request_id == "ghost", f"{name}: {ack}"
            else:  # a stranger learns nothing
                assert ack.mac == b"" and ack.request_id == "" and ack.nonce == b"", f"{name}: {ack}"
        replayed = wire.encode(signed(msgspec.structs.replace(reg, layer_addrs=[])))
        assert "layer addresses" in ch.ask(replayed).error
        assert "replay" in ch.ask(replayed).error
        for name, bad in bad_registers(reg, rng):
            ack, asked = ch.ask(wire.encode(signed(bad))), asked + 1
            assert ack is not None, f"{name}: no answer"
            assert not ack.accepted and ack.error and wire.verify(SECRET, ack), f"{name}: {ack}"
        for _ in range(20):  # multi-frame and frame-less junk from a DEALER: ignored, no reply due
            ch.send_frames([rng.randbytes(rng.randint(0, 30)) for _ in range(rng.choice([1, 2, 4, 9]))])
        for msg in (wire.Cancel(version=wire.PROTOCOL_VERSION, request_id="nobody", nonce=b"", timestamp=0.0),
                    wire.Fetch(version=wire.PROTOCOL_VERSION, request_id="nobody", nonce=b"", timestamp=0.0)):
            ack = ch.ask(wire.encode(signed(msg)))  # unknown ids: answered, nothing happens
            assert ack is not None and wire.verify(SECRET, ack)
            asked += not ack.accepted  # (a Fetch: refused, "not leased"; a Cancel: acknowledged)
        assert s.producer.refused_total - refused0 == asked + 2 and asked > 450  # (+2: the replay pair)
    finally:
        ch.close()
    # the service thread is alive and the waiting request intact: the real decode gets its KV
    assert s.producer.state("victim").name == "EXPECTING"
    blocks = list(range(10, 10 + -(-len(ids) // 16)))
    s.receiver.register("127.0.0.1", s.producer.port, "victim", blocks, 0, len(ids))
    assert s.wait("victim") == "done"
    fut.result(timeout=30)
    deadline = time.monotonic() + 10
    while (s.pool.num_used or s.producer.num_active) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.pool.num_used == 0 and s.producer.num_active == 0 and s.receiver.pending() == 0

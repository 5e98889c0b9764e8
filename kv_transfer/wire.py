"""Our own push handshake (connector mode): versioned msgspec messages, HMAC authentication, the
compatibility check, and the NIXL notification syntax. Both ends import this module: the prefill
server (``kv_transfer.push``) and our vLLM connector running inside the decode
(``kv_transfer.vllm.connector``), so it depends on nothing but msgspec and the standard library.

Exchange, per request (decode worker = client, prefill side channel = ZMQ ROUTER)::

    decode --Register{request_id, geometry, destination blocks, NIXL metadata, nonce, ts, mac}--> prefill
    decode <--Ack{request_id, accepted, error, nonce, write_timeout_s, mac}-------------------- prefill
    decode <==NIXL WRITE of layer l's pages, with notification "psv1 done <rid> <l>"=========== prefill
    ... one per layer; "psv1 fail <rid> <reason>" instead if the prefill gives up ...

Pull fallback (the decode asks for it: ``Register.transfer_mode == "pull"``; ``kv_transfer.pull``)::

    decode --Register{transfer_mode="pull", ...}--> prefill; <--Ack--  (prefill computes into its pool)
    decode <==notification "psv1 ready <rid> -"================ prefill (blocks leased)
    decode --Fetch{request_id, nonce, ts, mac}--> prefill
    decode <--Offer{its NIXL metadata, layer addresses, block ids, lease, token, mac}-- prefill
    decode ==NIXL READ, notification "psv1 read <rid> <token>"==> prefill (frees the lease)

Authentication: ``mac = HMAC-SHA256(secret, b"register" + canonical msgpack of every other field)``,
over a fresh random nonce and a timestamp; the prefill refuses a wrong mac, a timestamp more than
``MAX_CLOCK_SKEW_S`` away, or a nonce it has already seen, and answers a stranger with a refusal
that carries nothing else (no metadata, no addresses). The Ack is authenticated the same way over
the Register's nonce, so the decode knows it talks to a server holding the secret.

Compatibility: what matters for the bytes is compared field by field (``Geometry.mismatches``):
layers, KV heads, head_dim, block size, dtype and the model's fingerprint (a hash of the
architecture fields of config.json, not of a path string). Page layouts may differ: each side
names its own (vLLM's ``KVCacheLayout`` names) and gives its strides; ``kv_transfer.layout``
computes the descriptors and the conversion.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from collections import OrderedDict
from typing import Any

import msgspec

PROTOCOL_VERSION = 3  # 2: pull fallback (Fetch, Offer), page layouts with strides; 3: Ack.write_timeout_s
MAX_CLOCK_SKEW_S = 60.0
NOTIF_PREFIX = b"psv1"
# Page layout names are vLLM 0.32's ``KVCacheLayout`` names (``kv_transfer.layout``). "LBHNC": one
# block of one layer is [H, N, K|V] (K then V channels per token), which is also our pool's page.
PLAIN_PAGE = "LBHNC"
TRANSFER_MODES = ("push", "pull")  # kv_transfer.base.TransferMode's values (this module imports nothing of ours)
# kv_transfer_params[PARAMS_KEY] = {request_id, host, port, num_tokens, ...} sends a request to our connector
PARAMS_KEY = "prefill_server"

# config.json fields that decide the shapes of the K/V a model computes. Defaults are filled in
# the way transformers does, so a raw config.json (the prefill) and vLLM's parsed hf_config (the
# decode) agree. Weights are not hashed (too costly per start): serve the same checkpoint.
def model_fingerprint(hf_config: dict[str, Any]) -> str:
    """sha256 (16 hex) over the architecture fields of a Hugging Face config dict."""
    c = hf_config
    heads = c.get("num_attention_heads")
    picked = {
        "model_type": c.get("model_type"),
        "hidden_size": c.get("hidden_size"),
        "num_hidden_layers": c.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": c.get("num_key_value_heads") or heads,
        "head_dim": c.get("head_dim") or (c["hidden_size"] // heads if heads else None),
        "intermediate_size": c.get("intermediate_size"),
        "vocab_size": c.get("vocab_size"),
    }
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_of_dir(model_dir: str) -> str:
    with open(os.path.join(model_dir, "config.json")) as f:
        return model_fingerprint(json.load(f))


class Geometry(msgspec.Struct, frozen=True, kw_only=True):
    """What the KV bytes of one side look like."""

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32", "bfloat16", "float16"
    page_layout: str = PLAIN_PAGE

    @property
    def page_bytes(self) -> int:
        item = {"float32": 4, "bfloat16": 2, "float16": 2}.get(self.dtype, 0)
        return self.num_kv_heads * self.block_size * 2 * self.head_dim * item

    def mismatches(self, other: Geometry) -> list[str]:
        """Human-readable differences ('field: ours X, theirs Y'), empty if compatible. The page
        layouts may differ (``kv_transfer.layout`` checks and converts them)."""
        out = []
        for name in self.__struct_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if name == "page_layout":
                continue
            if a != b:
                out.append(f"{name}: prefill {a!r}, decode {b!r}")
        return out


class Register(msgspec.Struct, kw_only=True, tag="register"):
    """Decode -> prefill: where to write one request's KV."""

    version: int
    request_id: str  # the prefill server's id (from the request's kv_transfer_params)
    engine_id: str  # the decode worker's id (for logs)
    agent_name: str  # its NIXL agent
    agent_metadata: bytes  # its NIXL agent metadata (registered regions + connection info)
    geometry: Geometry
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    layer_addrs: list[int]  # address of (block 0, head 0, token 0) of each layer's cache, layer order
    block_stride: int  # bytes between consecutive blocks in a layer's cache
    block_ids: list[int]  # block_ids[t // block_size] holds token t of the prompt
    first_token: int  # tokens [first_token, num_tokens) are to be written (a prefix hit skips some)
    num_tokens: int
    nonce: bytes
    timestamp: float
    # bytes between heads / tokens inside a block (geometry.page_layout names the layout);
    # 0: the dense [H, N, K|V] page
    head_stride: int = 0
    token_stride: int = 0
    transfer_mode: str = "push"  # "pull": the prefill keeps the KV in its pool, the decode READs it
    mac: bytes = b""


class Cancel(msgspec.Struct, kw_only=True, tag="cancel"):
    """Decode -> prefill: the request was aborted on the decode; stop writing into its blocks.
    The Ack comes only once no WRITE of that request is in flight any more, so the decode may then
    reuse the blocks."""

    version: int
    request_id: str
    nonce: bytes
    timestamp: float
    mac: bytes = b""


class Fetch(msgspec.Struct, kw_only=True, tag="fetch"):
    """Decode -> prefill (pull): where is request_id's KV? Sent after the "ready" notification."""

    version: int
    request_id: str
    nonce: bytes
    timestamp: float
    mac: bytes = b""


class Offer(msgspec.Struct, kw_only=True, tag="offer"):
    """Prefill -> decode (pull): the leased blocks to READ, addressed like a Register's destination.
    ``release_token`` goes into the "read" notification that frees them."""

    version: int
    request_id: str
    agent_name: str
    agent_metadata: bytes  # the prefill's NIXL agent metadata (its KV pool region)
    page_layout: str
    mem_type: str
    device_id: int
    layer_addrs: list[int]
    block_stride: int
    head_stride: int
    token_stride: int
    block_ids: list[int]  # the prefill's blocks: block_ids[t // block_size] holds token t
    num_tokens: int
    lease_s: float  # the blocks stay leased this long from now (READ and notify before)
    release_token: str
    nonce: bytes = b""  # the Fetch's
    mac: bytes = b""


class Ack(msgspec.Struct, kw_only=True, tag="ack"):
    """Prefill -> decode: accepted (the WRITEs will come) or refused, with what to change."""

    version: int
    request_id: str
    accepted: bool
    error: str = ""
    nonce: bytes = b""  # the Register's nonce
    # accepted Register: after a Cancel reaches the prefill, none of the request's WRITEs stays in
    # flight longer than this (the prefill gives them up); the decode's Cancel waits that long
    write_timeout_s: float = 0.0
    mac: bytes = b""


Message = Register | Cancel | Fetch | Offer | Ack
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises ``msgspec.ValidationError``/``DecodeError`` on anything malformed."""
    return _decoder.decode(data)


# ---------------------------------------------------------------- authentication
def new_nonce() -> bytes:
    return secrets.token_bytes(16)


def _mac(secret: bytes, kind: bytes, msg: Message) -> bytes:
    body = msgspec.structs.replace(msg, mac=b"")
    return hmac.new(secret, kind + _encoder.encode(body), hashlib.sha256).digest()


def _kind(msg: Message) -> bytes:
    return msg.__struct_config__.tag.encode()


def sign(secret: bytes, msg: Message) -> Message:
    """``msg`` as its receiver will decode it (e.g. an int in a float field becomes a float: the
    receiver re-encodes what it decoded to check the mac), with its mac."""
    msg = _decoder.decode(_encoder.encode(msg))
    return msgspec.structs.replace(msg, mac=_mac(secret, _kind(msg), msg))


def verify(secret: bytes, msg: Message) -> bool:
    return hmac.compare_digest(msg.mac, _mac(secret, _kind(msg), msg))


class ReplayGuard:
    """Remembers nonces for ``MAX_CLOCK_SKEW_S`` so a captured Register cannot be sent again."""

    def __init__(self, window_s: float = MAX_CLOCK_SKEW_S, max_entries: int = 100_000):
        self.window_s, self.max_entries = window_s, max_entries
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def check(self, nonce: bytes, timestamp: float, now: float | None = None) -> str | None:
        """None if fresh (and remembers it), else why it is refused."""
        now = time.time() if now is None else now
        while self._seen and (next(iter(self._seen.values())) < now - self.window_s
                              or len(self._seen) > self.max_entries):
            self._seen.popitem(last=False)
        if abs(now - timestamp) > self.window_s:
            return f"timestamp is {now - timestamp:+.0f} s off (clocks must agree within {self.window_s:.0f} s)"
        if len(nonce) < 16:
            return "nonce shorter than 16 bytes"
        if nonce in self._seen:
            return "nonce already used (replay)"
        self._seen[nonce] = now
        return None


def load_secret(secret: str | None = None, secret_file: str | None = None,
                env: str = "PREFILL_SERVER_SECRET") -> bytes:
    """The shared secret from (in order) an explicit value, a file, or the environment variable.
    Raises ``ValueError`` saying how to provide one."""
    if secret:
        value = secret
    elif secret_file:
        with open(secret_file) as f:
            value = f.read().strip()
    else:
        value = os.environ.get(env, "")
    if len(value) < 16:
        raise ValueError("connector mode needs a shared secret of at least 16 characters on both "
                         f"sides: set {env} (or --secret-file / kv_connector_extra_config.secret_file)")
    return value.encode()


# ---------------------------------------------------------------- notifications (over NIXL)
def done_notif(request_id: str, layer: int) -> bytes:
    return b" ".join((NOTIF_PREFIX, b"done", request_id.encode(), str(layer).encode()))


def fail_notif(request_id: str, reason: str) -> bytes:
    return b" ".join((NOTIF_PREFIX, b"fail", request_id.encode(), reason.encode()[:400]))


def ready_notif(request_id: str) -> bytes:
    """Prefill -> decode (pull): the KV is computed and leased; send a Fetch."""
    return b" ".join((NOTIF_PREFIX, b"ready", request_id.encode(), b"-"))


def read_notif(request_id: str, release_token: str) -> bytes:
    """Decode -> prefill (pull), carried by the READ: the KV is read; free the lease."""
    return b" ".join((NOTIF_PREFIX, b"read", request_id.encode(), release_token.encode()))


_NOTIF_KINDS = (b"done", b"fail", b"ready", b"read")


def parse_notif(msg: bytes) -> tuple[str, str, str] | None:
    """(kind, request_id, arg) for 'done' (arg = layer), 'fail' (arg = reason), 'ready' (arg '-')
    and 'read' (arg = release token); None if the message is not ours or malformed."""
    parts = msg.split(b" ", 3)
    if len(parts) != 4 or parts[0] != NOTIF_PREFIX or parts[1] not in _NOTIF_KINDS:
        return None
    try:
        return parts[1].decode(), parts[2].decode(), parts[3].decode(errors="replace")
    except UnicodeDecodeError:
        return None

"""The decode's side in tests without vLLM: KV caches laid out the way vLLM 0.32 lays them out
(``v1/kv_cache_interface.py``: ``compute_layout_strides`` + ``create_kv_cache_views``): one raw
buffer for all layers, per-layer logical ``[B, H, N, C]`` views (C = K|V, 2*D) whose strides
follow a ``KVCacheLayout`` permutation of ``[L, B, H, N, C]``, and the independent byte arithmetic
the tests check them with; waiting on a receiver; raw side-channel requests."""
from __future__ import annotations

import math
import time

import torch
import zmq

from kv_transfer import wire

# KVCacheLayout values (vllm/v1/kv_cache_layout.py): physical order of the logical [L, B, H, N, C]
ORDER = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
         "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def strides(layout: str, L: int, NB: int, H: int, N: int, C: int) -> tuple[int, ...]:
    """Element strides of [L, B, H, N, C] (dense, no padding)."""
    shape, order = (L, NB, H, N, C), ORDER[layout]
    out, acc = [0] * 5, 1
    for dim in reversed(order):
        out[dim] = acc
        acc *= shape[dim]
    return tuple(out)


class Views:
    """``raw``: the flat buffer; ``caches[l]``: layer l's [NB, H, N, C] view."""

    def __init__(self, layout: str, L: int, NB: int, H: int, N: int, D: int, dtype=torch.float32):
        self.layout, self.L, self.NB, self.H, self.N, self.D = layout, L, NB, H, N, D
        self.st = strides(layout, L, NB, H, N, 2 * D)
        self.raw = torch.zeros(math.prod((L, NB, H, N, 2 * D)), dtype=dtype)
        v5 = self.raw.as_strided((L, NB, H, N, 2 * D), self.st)
        self.caches = [v5[layer] for layer in range(L)]

    def read_raw(self, layer: int, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [T, H, D] of tokens 0..T-1 (token t in block_ids[t // N] at slot t % N), gathered
        from the raw buffer by plain offset arithmetic (not through the views)."""
        sL, sB, sH, sN, _ = self.st
        t = torch.arange(num_tokens)
        b = torch.tensor(block_ids, dtype=torch.long)[t // self.N]
        off = layer * sL + b * sB + (t % self.N) * sN  # [T]
        idx = (off[:, None, None] + torch.arange(self.H)[None, :, None] * sH
               + torch.arange(2 * self.D)[None, None, :])
        kv = self.raw[idx]  # [T, H, 2D]
        return kv[..., : self.D], kv[..., self.D:]

    def read_like_flash_attn(self, layer: int, block_ids: list[int], num_tokens: int):
        """K, V [T, H, D] as vLLM's FLASH_ATTN backend reads them: ``kv_cache.transpose(1, 2)
        .split(head_size, dim=-1)`` -> [B, N, H, D] each, indexed by the block table."""
        key_cache, value_cache = self.caches[layer].transpose(1, 2).split(self.D, dim=-1)
        t = torch.arange(num_tokens)
        b = torch.tensor(block_ids, dtype=torch.long)[t // self.N]
        return key_cache[b, t % self.N], value_cache[b, t % self.N]


def wait_done(receiver, rid: str, timeout: float = 60.0) -> str:
    """"done", the failure reason, or "timeout"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = receiver.poll()
        if rid in r.done:
            return "done"
        if rid in r.failed:
            return r.failed[rid]
        time.sleep(0.005)
    return "timeout"


def request(port: int, body: bytes, host: str = "127.0.0.1") -> list[bytes]:
    """One REQ round trip to a side channel, as any peer could make it: the answer's frames."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://{host}:{port}")
    try:
        sock.send(body)
        return sock.recv_multipart()
    finally:
        sock.close(linger=0)
        ctx.term()


def ask(port: int, msg) -> wire.Message:
    """Send one message to a prefill's side channel as any peer could; its answer."""
    return wire.decode(request(port, wire.encode(msg))[0])


def get_meta(port: int, host: str = "127.0.0.1") -> list[bytes]:
    """A vLLM NixlConnector decode's handshake (pp 0, tp 0): the two frames the producer answers
    (its ``NixlHandshakePayload`` and a clock reading)."""
    import msgspec

    from kv_transfer.vllm import nixl_wire

    return request(port, msgspec.msgpack.encode((nixl_wire.GET_META_MSG, 0, 0)), host)


def wait_until(cond, timeout=5.0) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` seconds pass (False)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True

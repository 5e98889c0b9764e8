"""The decode's side of a pull READ (our connector's pull fallback, and a request computed first):
check the prefill's signed Offer and build the READ's descriptors from it. The prefill's side is
``kv_transfer.pull``; this module is imported by the decode's receiver and depends on nothing of
the prefill side."""
from __future__ import annotations

import numpy as np

from kv_transfer import layout, wire


def check_offer(offer: wire.Offer, fetch_nonce: bytes, geometry: wire.Geometry, num_tokens: int,
                secret: bytes) -> str | None:
    """Why the decode must not READ what ``offer`` points at, or None."""
    if offer.nonce != fetch_nonce or not wire.verify(secret, offer):
        return "the prefill server's Offer failed authentication (wrong secret?)"
    if offer.version != wire.PROTOCOL_VERSION:
        return f"the prefill server speaks protocol version {offer.version}, this decode {wire.PROTOCOL_VERSION}"
    if offer.num_tokens != num_tokens:
        return f"the prefill server has {offer.num_tokens} prompt tokens, the decode {num_tokens}"
    if len(offer.layer_addrs) != geometry.num_layers:
        return f"the prefill server offers {len(offer.layer_addrs)} layers, the decode has {geometry.num_layers}"
    if len(offer.block_ids) * geometry.block_size < num_tokens:
        return f"the prefill server offers {len(offer.block_ids)} blocks for {num_tokens} tokens"
    try:
        src = offer_addressing(offer, geometry)
    except ValueError as e:
        return f"the prefill server's pages: {e}"
    if src.interior != "HNC" or offer.mem_type not in ("DRAM", "VRAM"):
        return f"the prefill server's page layout {offer.page_layout} ({offer.mem_type}) cannot be read here"
    return None


def offer_addressing(offer: wire.Offer, g: wire.Geometry) -> layout.Addressing:
    return layout.of_wire(offer.page_layout, offer.layer_addrs, offer.block_stride, offer.head_stride,
                          offer.token_stride, g)


def read_descs(offer: wire.Offer, g: wire.Geometry, local: layout.Addressing, block_ids: list[int],
               first_token: int, num_tokens: int, local_dev: int) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) Nx3 descriptors of one READ that brings tokens [first_token, num_tokens) of
    every layer from the prefill's blocks into the decode's ``block_ids`` (``check_offer`` first)."""
    first, last = first_token // g.block_size, -(-num_tokens // g.block_size)
    src = offer_addressing(offer, g)
    chunks = layout.page_chunks(local)
    loc, rem = [], []
    for layer in range(g.num_layers):
        s = src.layer_addrs[layer] + np.asarray(offer.block_ids[first:last], dtype=np.int64) * src.block_stride
        d = local.layer_addrs[layer] + np.asarray(block_ids[first:last], dtype=np.int64) * local.block_stride
        r, l_ = layout.descs(s, d, chunks, offer.device_id, local_dev)
        rem.append(r)
        loc.append(l_)
    return np.concatenate(loc), np.concatenate(rem)

"""SGLang 0.5.23's decode -> prefill messages as ``kv_transfer.sglang.v0_5_23`` parses them, and
what we send back; junk from the network only ever gives ``MalformedMessage``. The frame builders
here follow the frame lists in the module's docstring (the real decode's frames are checked by
test_sglang_decode.py, with SGLang's own classes)."""
from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from kv_transfer.sglang import v0_5_23 as wire
from kv_transfer.sglang.peers import Geometry, Peer, destination, registration_refusal


def _q(xs) -> bytes:
    return struct.pack(f"<{len(xs)}Q", *xs)


def registration_frames(*, endpoint="127.0.0.1", port=5555, agent="decode-agent", metadata=b"meta",
                        kv_ptrs=(0x1000, 0x2000), aux_ptrs=tuple(range(0x100, 0x10A)), item_len=256,
                        num_slots=16, tp_size=1, mem="DRAM", item_lens=None) -> list[bytes]:
    """A decode rank's 25-frame registration (NixlKVManager's layout in SGLang 0.5.23)."""
    n = len(kv_ptrs)
    return [wire.GUARD, b"None", endpoint.encode(), str(port).encode(), agent.encode(), metadata, _q(kv_ptrs),
            _q(aux_ptrs), b"", b"0", str(tp_size).encode(), b"0", str(item_len).encode(), b"", b"", b"", b"",
            str(num_slots).encode(), ",".join([mem] * n).encode(), _q(item_lens or [item_len] * n), b"", b"",
            b"1", b"0", b""]


def transfer_info_frames(room, pages, *, endpoint="127.0.0.1", port=5555, agent="decode-agent", aux=0,
                         required=1, prefix=0, dummy=0) -> list[bytes]:
    """One room's 11-frame transfer info."""
    return [wire.GUARD, str(room).encode(), endpoint.encode(), str(port).encode(), agent.encode(),
            np.asarray(pages, dtype=np.int32).tobytes(), str(aux).encode(), str(required).encode(), b"",
            str(prefix).encode(), str(dummy).encode()]


def test_a_registration_parses_into_what_the_writes_need():
    reg = wire.parse(registration_frames(kv_ptrs=(1, 2, 3, 4), item_len=64, num_slots=9))
    assert isinstance(reg, wire.Registration)
    assert (reg.endpoint, reg.port, reg.agent_name, reg.agent_metadata) == ("127.0.0.1", 5555, "decode-agent", b"meta")
    assert reg.kv_ptrs == (1, 2, 3, 4) and reg.kv_item_lens == (64,) * 4 and reg.num_slots == 9
    assert reg.kv_mem_kind == "DRAM" and len(reg.aux_ptrs) == 10 and not reg.has_state


def test_a_transfer_info_and_aborts_parse():
    info = wire.parse(transfer_info_frames(77, [5, 6, 9], aux=3, prefix=8))
    assert isinstance(info, wire.TransferInfo)
    assert (info.room, info.aux_index, info.prefix_len, info.required_dst_info_num) == (77, 3, 8, 1)
    assert info.pages.tolist() == [5, 6, 9] and not info.is_dummy
    assert wire.parse([wire.ABORT, b"77"]) == wire.Abort(77)
    assert wire.parse([wire.ABORT, b"77", b"10.0.0.2", b"6000", b"3"]) == wire.Abort(77, "10.0.0.2", 6000, 3)
    # a bad return address keeps the room (as SGLang's parser does): no ACK is owed then
    assert wire.parse([wire.ABORT, b"77", b"bad host!", b"x"]) == wire.Abort(77)


def test_what_we_send_back():
    assert wire.kv_status(9, True) == [b"KV_STATUS", b"9", b"4", b"0", b""]
    assert wire.kv_status(9, False, "no pages") == [b"KV_STATUS", b"9", b"0", b"0", b"no pages"]
    assert wire.abort_ack(9, 2) == [b"ABORT_ACK", b"9", b"0", b"2"]


BAD = [
    [], [b""], [b"HELLO"], [wire.GUARD], [wire.ABORT], [wire.ABORT, b"x"], [wire.ABORT, b"-1"],
    [wire.ABORT, str(2**63).encode()], [wire.ABORT, b"1", b"h", b"1", b"2", b"extra"],
    registration_frames()[:-1], registration_frames() + [b""],  # another version's frame counts
    transfer_info_frames(1, [1])[:-1], transfer_info_frames(1, [1]) + [b"0"],
    transfer_info_frames(b"1e3".decode(), [1]), transfer_info_frames(1, [1], port=0),
    transfer_info_frames(1, [-4]), transfer_info_frames(1, [1])[:5] + [b"\x01\x02\x03"] + transfer_info_frames(1, [1])[6:],
    registration_frames(kv_ptrs=()), registration_frames(kv_ptrs=(0, 8)), registration_frames(aux_ptrs=()),
    registration_frames(mem="HBM"), registration_frames(tp_size=0), registration_frames(metadata=b""),
    registration_frames(agent="has space"), registration_frames(endpoint=""), registration_frames(item_lens=[256]),
    registration_frames()[:6] + [b"\x00" * 7] + registration_frames()[7:],
]


@pytest.mark.parametrize("frames", BAD, ids=range(len(BAD)))
def test_malformed_messages_are_refused_with_a_reason(frames):
    with pytest.raises(wire.MalformedMessage) as e:
        wire.parse(frames)
    assert str(e.value)


def test_fuzz_junk_frames_only_ever_give_malformed_message():
    rng = random.Random(18)
    seeds = [registration_frames(), transfer_info_frames(5, [1, 2, 3]), [wire.ABORT, b"5", b"h", b"1", b"2"]]
    parsed = 0
    for _ in range(3000):
        frames = [bytearray(f) for f in rng.choice(seeds)]
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            i = rng.randrange(len(frames))
            if kind < 0.4 and frames[i]:
                frames[i][rng.randrange(len(frames[i]))] = rng.randrange(256)
            elif kind < 0.6:
                frames[i] = bytearray(rng.randbytes(rng.randint(0, 40)))
            elif kind < 0.8:
                del frames[i]
            else:
                frames.insert(i, bytearray(rng.randbytes(rng.randint(0, 9))))
            if not frames:
                break
        try:
            wire.parse([bytes(f) for f in frames])
            parsed += 1
        except wire.MalformedMessage:
            pass
    assert parsed < 3000  # (and nothing but MalformedMessage escaped)


def test_server_info_has_exactly_prefill_server_info_fields():
    """SGLang builds ``PrefillServerInfo(**json)``: an unknown key would fail every request."""
    fields_0_5_23 = {"attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
                     "follow_bootstrap_room", "enable_dsa_cache_layer_split", "dsv41_spec_layout", "kv_layout",
                     "decode_allocation_policy", "enable_kv_cache_sharding", "prefill_http_port", "target_tp_rank",
                     "target_tp_ranks", "target_cp_ranks", "target_pp_ranks", "required_dst_info_num",
                     "required_prefill_response_num"}
    info = wire.server_info(wire.our_rank("10.0.0.1", 7000, 16, "auto", None))
    assert set(info) <= fields_0_5_23
    assert (info["page_size"], info["kv_cache_dtype"], info["attn_tp_size"], info["dp_size"]) == (16, "auto", 1, 1)
    assert info["follow_bootstrap_room"] is True and info["decode_allocation_policy"] == "early"


G = Geometry(num_layers=2, num_kv_heads=2, head_dim=8, itemsize=4, page_size=4)  # item_len 256


def test_registration_refusals_say_what_to_change():
    ok = wire.parse(registration_frames(kv_ptrs=(1, 2, 3, 4), item_len=G.item_len))
    assert registration_refusal(ok, G) == ""
    cases = {"--page-size": dict(kv_ptrs=(1, 2, 3, 4), item_len=128), "same model": dict(kv_ptrs=(1, 2)),
             "TP 1": dict(kv_ptrs=(1, 2, 3, 4), item_len=256, tp_size=2),
             "metadata buffers": dict(kv_ptrs=(1, 2, 3, 4), item_len=256, aux_ptrs=tuple(range(1, 13)))}
    for words, kw in cases.items():
        assert words in registration_refusal(wire.parse(registration_frames(**kw)), G)


def test_destination_coalesces_runs_of_consecutive_pages():
    peer = Peer(wire.parse(registration_frames(kv_ptrs=(1, 2, 3, 4), item_len=G.item_len, num_slots=64)),
                remote="d", aux=wire.aux_layout(10))
    # 22 tokens from token 4 (the decode holds one page): 18 rows in pages 7 8 9 | 20 | 3 (last partial)
    d = destination(peer, wire.parse(transfer_info_frames(5, [7, 8, 9, 20, 3], prefix=4)), 22, G)
    row = G.row_bytes
    assert d.first_token == 4 and d.num_rows == 18
    assert d.src_off.tolist() == [0, 12 * row, 16 * row]
    assert d.dst_off.tolist() == [7 * G.item_len, 20 * G.item_len, 3 * G.item_len]
    assert d.length.tolist() == [12 * row, 4 * row, 2 * row]


@pytest.mark.parametrize("pages,prefix,n,words", [
    ([1, 2], 0, 12, "needs 3"), ([1, 2, 3, 4], 0, 12, "needs 3"), ([1, 2, 3, 4], 4, 9, "needs 2"),
    ([0, 1, 2], 0, 12, "page 0 is padding"), ([1, 64, 2], 0, 12, "outside"),
    ([1, 2, 3], 2, 12, "page-aligned"), ([1], 16, 12, "longer than the prompt")])
def test_destination_refusals(pages, prefix, n, words):
    peer = Peer(wire.parse(registration_frames(kv_ptrs=(1, 2, 3, 4), item_len=G.item_len, num_slots=64)),
                remote="d", aux=wire.aux_layout(10))
    assert words in destination(peer, wire.parse(transfer_info_frames(5, pages, prefix=prefix)), n, G)


def test_destination_refuses_unknown_decodes_and_room_zero():
    info = wire.parse(transfer_info_frames(0, [1]))
    assert "never registered" in destination(None, info, 4, G)
    peer = Peer(wire.parse(registration_frames(kv_ptrs=(1, 2, 3, 4), item_len=G.item_len)), remote="d",
                aux=wire.aux_layout(10))
    assert "room 0" in destination(peer, info, 4, G)
    assert "TP" in destination(peer, wire.parse(transfer_info_frames(3, [1], required=2)), 4, G)

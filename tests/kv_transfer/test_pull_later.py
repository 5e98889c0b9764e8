"""Connector mode, computed first (route LEASE_FOR_LATER): the engine computes a prompt with
no decode in sight and leases its KV; the decode (a ``PushReceiver``, as our vLLM connector uses
it) registers afterwards, asking pull for the prefill's ``num_tokens``, and READs the lease over
NIXL/UCX on DRAM. Also: what such a lease refuses, and how it ends when nobody reads it."""
from __future__ import annotations

import time

import msgspec
import pytest
import torch

from kv_transfer import wire
from kv_transfer.base import Route, TransferState
from kv_transfer.wire import PARAMS_KEY
from prefill_server.engine.types import PrefillRequest
from prefill_server.errors import InvalidRequest
from decode_side import ask
from test_pull import PullSetup
from test_push import BS, SECRET, assert_received_equals, received, reference_kv


@pytest.fixture(scope="module")
def loaded():
    from prefill_server.config import EngineConfig
    from prefill_server.engine import build

    return build.load(EngineConfig(dtype="float32"))


def compute_first(s: PullSetup, rid: str, ids: list[int]):
    """Submit a LEASE_FOR_LATER request; its result (computed and leased: nobody registered)."""
    return s.engine.submit(PrefillRequest(rid, tuple(ids), route=Route.LEASE_FOR_LATER)).result(timeout=120)


def signed_register(s: PullSetup, rid: str, num_tokens: int, mode: str) -> wire.Register:
    msg = s.receiver.register_message(rid, list(range(-(-(num_tokens + 1) // BS))), 0, num_tokens, mode)
    return wire.sign(SECRET, msgspec.structs.replace(msg, nonce=wire.new_nonce(), timestamp=time.time()))


def test_computed_first_then_a_pull_register_reads_the_lease_and_frees_it(loaded):
    # a register timeout far shorter than the wait before the decode comes: it must not apply
    s = PullSetup(loaded, token_budget=64, register_timeout_s=0.3)
    try:
        ids = loaded.tokenizer.encode("Computed before the decode has even heard of it. " * 8)
        n = len(ids)
        res = compute_first(s, "pl1", ids)
        p = res.kv_transfer_params[PARAMS_KEY]
        assert p == {"version": wire.PROTOCOL_VERSION, "request_id": "pl1", "host": "127.0.0.1",
                     "port": s.producer.port, "num_tokens": n, "transfer_mode": "pull"}
        assert res.num_prompt_tokens == n and res.timings.total_s >= res.timings.prefill_s > 0
        ref_logits, attn = reference_kv(loaded, ids)
        assert res.first_token_id == int(torch.argmax(ref_logits))
        assert s.producer.state("pl1") is TransferState.LEASED
        lease = s.pool.get_lease("pl1")
        pool_kv = [s.pool.read(layer, lease.block_ids, n) for layer in range(s.pool.num_layers)]
        time.sleep(0.6)  # past the register timeout: a lease does not wait for a Register
        assert s.pool.get_lease("pl1") is not None
        # the decode's prompt is the prefill's plus its first token: blocks for n + 1 tokens
        blocks = list(range(100, 100 - -(-(n + 1) // BS), -1))
        s.receiver.register(p["host"], p["port"], "pl1", blocks, 0, p["num_tokens"], mode="pull")
        assert s.wait("pl1") == "done"
        for layer, (k, v) in enumerate(pool_kv):  # the READ brought exactly the pool's K/V
            rk, rv = received(s.caches, layer, blocks, n)
            assert torch.equal(rk, k) and torch.equal(rv, v)
        assert_received_equals(s.caches, blocks, attn, n)
        assert s.wait_pool_empty() == 0 and s.producer.num_active == 0
        assert s.producer.state("pl1") is TransferState.RELEASED
        st = s.producer.stats()
        assert st.released_total == 1 and st.handshakes_total == 1
    finally:
        s.close()


def test_only_the_connector_routes_are_taken(setup_default):
    s = setup_default
    with pytest.raises(InvalidRequest, match="connector mode"):  # a plain LEASE request still is not
        s.engine.submit(PrefillRequest("plain", (1, 2, 3)))
    with pytest.raises(InvalidRequest, match="stream-then-pull"):  # the engine's own turn, never asked for
        s.engine.submit(PrefillRequest("both", (1, 2, 3), route=Route.STREAM_THEN_PULL))


def test_a_push_or_wrong_length_register_is_refused_and_the_lease_expires(loaded):
    s = PullSetup(loaded, lease_ttl_s=1.5)
    try:
        ids = loaded.tokenizer.encode("Only a puller of the right length may have me.")
        n = len(ids)
        compute_first(s, "pr1", ids)
        port = s.producer.port
        fetch = wire.sign(SECRET, wire.Fetch(version=wire.PROTOCOL_VERSION, request_id="pr1",
                                             nonce=wire.new_nonce(), timestamp=time.time()))
        early = ask(port, fetch)  # nobody registered: nobody may READ it
        assert isinstance(early, wire.Ack) and not early.accepted and "no decode has registered" in early.error
        push = ask(port, signed_register(s, "pr1", n, "push"))
        assert not push.accepted and "can only be pulled" in push.error
        longer = ask(port, signed_register(s, "pr1", n + 1, "pull"))
        assert not longer.accepted and f"asks for {n + 1} tokens, the prefill computed {n}" in longer.error
        # a decode whose connector asks push is told why
        s.receiver.register("127.0.0.1", port, "pr1", [0, 1], 0, n, mode="push")
        assert "can only be pulled" in s.wait("pr1")
        assert s.producer.state("pr1") is TransferState.LEASED and s.pool.num_used == 1
        assert s.wait_pool_empty(10) == 0  # the lease's deadline frees it
        assert s.producer.state("pr1") is TransferState.EXPIRED
        assert s.producer.stats().leases_expired_total == 1 and s.producer.refused_total >= 4
    finally:
        s.close()


def test_a_lease_nobody_registers_for_expires(loaded):
    s = PullSetup(loaded, lease_ttl_s=1.0, register_timeout_s=0.2)
    try:
        compute_first(s, "nobody", loaded.tokenizer.encode("Nobody comes for me."))
        assert s.pool.num_used == 1 and s.producer.state("nobody") is TransferState.LEASED
        assert s.wait_pool_empty(10) == 0
        assert s.producer.state("nobody") is TransferState.EXPIRED
        assert s.producer.stats().leases_expired_total == 1
        s.receiver.register("127.0.0.1", s.producer.port, "nobody", [0, 1], 0, 5, mode="pull")
        assert "not waiting for a decode" in s.wait("nobody")  # too late: refused
    finally:
        s.close()


def test_abort_frees_a_computed_lease_at_once(setup_default, loaded):
    s = setup_default
    compute_first(s, "ab1", loaded.tokenizer.encode("Released by the gateway."))
    assert s.pool.num_used == 1
    assert s.engine.abort("ab1")
    assert s.pool.num_used == 0 and s.producer.num_active == 0
    assert s.producer.state("ab1") is TransferState.ABORTED


@pytest.fixture()
def setup_default(loaded):
    s = PullSetup(loaded)
    yield s
    s.close()

"""Connector mode's pull fallback without vLLM: the decode (a ``PushReceiver`` registering with
mode "pull") asks for it; the real engine (embedded SmolLM2, fp32) computes the prompt into its
pool, leases the blocks, the decode READs them over NIXL/UCX on DRAM and its notification frees
them. Failure paths: lease expiry, cancels on both sides, prefill failure, strangers."""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch

from kv_transfer import wire
from kv_transfer.base import Route, TransferState
from kv_transfer.wire import PARAMS_KEY
from kv_transfer.receiver import PushReceiver
from prefill_server.engine.types import PrefillRequest
from prefill_server.errors import TransferError
from decode_side import ask
from test_push import BS, SECRET, Setup, assert_received_equals, geometry, reference_kv


@pytest.fixture(scope="module")
def loaded():
    from prefill_server.config import EngineConfig
    from prefill_server.engine import build

    return build.load(EngineConfig(dtype="float32"))


class PullSetup(Setup):
    def __init__(self, loaded, token_budget=4096, lease_ttl_s=30.0, **kw):
        super().__init__(loaded, **kw)
        self.engine.scheduler.token_budget = token_budget
        self.producer.pull.lease_ttl_s = lease_ttl_s

    def run_pull(self, rid, ids, block_ids, receiver=None):
        receiver = receiver or self.receiver
        fut, params = self.engine.start_stream(PrefillRequest(rid, tuple(ids), route=Route.STREAM))
        p = params[PARAMS_KEY]
        receiver.register(p["host"], p["port"], rid, block_ids, 0, len(ids), mode="pull")
        return fut

    def wait_pool_empty(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while (self.pool.num_used or self.producer.num_active) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.pool.num_used


@pytest.fixture()
def setup(loaded):
    s = PullSetup(loaded)
    yield s
    s.close()


def test_pulled_kv_equals_a_plain_forward_and_the_read_frees_it(loaded):
    s = PullSetup(loaded, token_budget=64)  # chunked: later chunks read earlier ones from the pool
    try:
        ids = loaded.tokenizer.encode("The decode reads what the prefill leased. " * 12)
        blocks = list(range(100, 100 - -(-len(ids) // BS), -1))
        fut = s.run_pull("p1", ids, blocks)
        res = fut.result(timeout=120)  # the engine's part ends at the lease
        assert s.wait("p1") == "done"
        ref_logits, attn = reference_kv(loaded, ids)
        assert res.first_token_id == int(torch.argmax(ref_logits))
        assert_received_equals(s.caches, blocks, attn, len(ids))
        assert s.wait_pool_empty() == 0 and s.producer.num_active == 0
        assert s.producer.state("p1") is TransferState.RELEASED
        st = s.producer.stats()
        assert st.released_total == 1 and st.bytes_released_total > 0
    finally:
        s.close()


class NoFetch(PushReceiver):
    """A decode that registers for pull and then never fetches (stuck, or gone quiet)."""

    def _on_notif(self, msg, now):
        if b" ready " not in msg:
            super()._on_notif(msg, now)


def test_lease_expires_when_the_decode_never_reads(loaded):
    s = PullSetup(loaded, lease_ttl_s=1.0)
    quiet = NoFetch(s.caches, geometry(loaded), SECRET, timeout_s=30)
    try:
        ids = loaded.tokenizer.encode("Nobody reads me.")
        s.run_pull("e1", ids, [0], receiver=quiet).result(timeout=60)
        assert s.pool.num_used == 1  # leased
        assert s.wait_pool_empty(10) == 0
        assert s.producer.state("e1") is TransferState.EXPIRED
        assert s.producer.stats().leases_expired_total == 1
        assert "lease ran out" in s.wait("e1", receiver=quiet)  # the decode was told
    finally:
        quiet.close()
        s.close()


def test_decode_cancel_frees_both_sides_while_computing_or_leased(setup, loaded):
    ids = loaded.tokenizer.encode("Cancel me. " * 40)
    blocks = list(range(-(-len(ids) // BS)))
    # leased, not fetched: a decode that does not fetch, then cancels
    quiet = NoFetch(setup.caches, geometry(loaded), SECRET, timeout_s=30)
    try:
        p = setup.run_pull("c1", ids, blocks, receiver=quiet).result(timeout=60).kv_transfer_params
        assert setup.pool.num_used > 0
        quiet.cancel(p[PARAMS_KEY]["host"], p[PARAMS_KEY]["port"], "c1")
        deadline = time.monotonic() + 10
        cancelled = set()
        while "c1" not in cancelled and time.monotonic() < deadline:
            cancelled |= quiet.poll().cancelled
            time.sleep(0.01)
        assert "c1" in cancelled and setup.wait_pool_empty() == 0
        assert setup.producer.state("c1") is TransferState.ABORTED
    finally:
        quiet.close()
    # while the prefill computes (its forward held until the Cancel was handled, however slow the
    # machine): the engine fails the request and frees its blocks
    run, cancel = setup.engine.runner.run, setup.producer._cancel
    computing, cancelled = threading.Event(), threading.Event()

    def held(chunks):
        computing.set()
        assert cancelled.wait(60), "the decode's Cancel never reached the prefill"
        return run(chunks)

    def noted(identity, msg):
        cancel(identity, msg)
        cancelled.set()

    setup.engine.runner.run, setup.producer._cancel = held, noted
    try:
        fut = setup.run_pull("c2", ids, blocks)
        assert computing.wait(60) and setup.producer.wants_pull("c2")
        setup.receiver.cancel("127.0.0.1", setup.producer.port, "c2")
        with pytest.raises(Exception, match="cancelled by the decode|aborted"):
            fut.result(timeout=120)
    finally:
        setup.engine.runner.run, setup.producer._cancel = run, cancel
    assert setup.wait_pool_empty() == 0


def test_prefill_failure_fails_the_decode_request(setup, loaded):
    run = setup.engine.runner.run

    def failing(chunks):
        raise RuntimeError("injected prefill failure")

    setup.engine.runner.run = failing
    try:
        fut = setup.run_pull("f1", loaded.tokenizer.encode("Fail me."), [0])
        with pytest.raises(RuntimeError, match="injected"):
            fut.result(timeout=60)
    finally:
        setup.engine.runner.run = run
    assert "injected prefill failure" in setup.wait("f1")
    assert setup.wait_pool_empty() == 0


def test_prompt_too_large_for_the_pool_is_refused_in_pull(loaded):
    s = PullSetup(loaded, num_blocks=8)  # push streams 8 x 16 tokens fine; pull needs it all resident
    try:
        ids = loaded.tokenizer.encode("Too large to hold whole. " * 40)
        fut = s.run_pull("big", ids, list(range(-(-len(ids) // BS))))
        assert "pull mode needs" in s.wait("big")
        with pytest.raises(TransferError, match="pull mode needs"):
            fut.result(timeout=30)
        assert s.pool.num_used == 0 and s.producer.num_active == 0
    finally:
        s.close()


def test_strangers_get_no_offer_and_cannot_free_a_lease(setup, loaded):
    ids = loaded.tokenizer.encode("Whose blocks are these?")
    quiet = NoFetch(setup.caches, geometry(loaded), SECRET, timeout_s=30)
    try:
        setup.run_pull("s1", ids, [0], receiver=quiet).result(timeout=60)
        port = setup.producer.port
        fetch = wire.Fetch(version=wire.PROTOCOL_VERSION, request_id="s1", nonce=wire.new_nonce(),
                           timestamp=time.time())
        bad = ask(port, wire.sign(b"not-the-secret-0123456", fetch))
        assert isinstance(bad, wire.Ack) and not bad.accepted and bad.mac == b""
        offer = ask(port, wire.sign(SECRET, fetch))  # the right secret gets the Offer
        assert isinstance(offer, wire.Offer) and wire.verify(SECRET, offer) and offer.nonce == fetch.nonce
        other = msgspec.structs.replace(fetch, nonce=wire.new_nonce(), request_id="nope")
        again = ask(port, wire.sign(SECRET, other))
        assert not again.accepted and "no KV leased" in again.error
        # a "read" notification with the wrong token does not free the lease
        with quiet._agent_lock:
            remote = quiet.agent.add_remote(offer.agent_metadata)
            quiet.agent.send_notif(remote, wire.read_notif("s1", "0" * 32))
        time.sleep(0.5)
        assert setup.pool.num_used == 1 and setup.producer.stats().bad_notifications_total >= 1
        with quiet._agent_lock:  # the right token does
            quiet.agent.send_notif(remote, wire.read_notif("s1", offer.release_token))
        assert setup.wait_pool_empty(10) == 0
    finally:
        quiet.close()

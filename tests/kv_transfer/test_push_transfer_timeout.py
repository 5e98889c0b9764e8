"""Connector mode, a WRITE that never completes (issue 3): the decode died with a layer's WRITE in
flight and NIXL never fails it. Aborting that request must not stall the engine (no wait under
its lock, none longer than the producer's short ``abort_wait_s`` on its thread); its staging
blocks come back once the configured transfer timeout gives the WRITE up. Also: the timeout is a
setting (``serve --transfer-timeout``, ``ServerConfig``), capped at the lease time by default.

The WRITEs are real (NIXL/UCX on DRAM, the engine and receiver of test_push.py); only the
producer's handle-state check is substituted, reporting "PROC" forever for the stuck ones. The
prefix cache is off where blocks are counted: with it, a prompt the pool has room for streams from
whole blocks of its own instead of the two staging layers these counts expect."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from kv_transfer import wire
from kv_transfer.receiver import REPROBE_S
from kv_transfer.base import TransferState
from kv_transfer.vllm.discovery import DecodeFacts
from prefill_server.cli import main
from prefill_server.config import ConnectorConfig, EngineConfig, ServerConfig
from prefill_server.errors import RequestCancelled, TransferError
from test_push import BS, Setup, _registered, hold_at_layer, loaded  # noqa: F401 - (loaded: a fixture)


def stick_writes(producer, request_id: str, from_layer: int) -> threading.Event:
    """From now on, the WRITEs of ``request_id``'s layers >= ``from_layer`` report "PROC" forever
    (the real check still runs, so NIXL moves them on and their handles can be released). Returns
    an event set once the first of them is posted."""
    agent, stuck, posted = producer._agent, [], threading.Event()
    post, poll = agent.post, agent.poll

    def posting(op, src, dst, remote, mem_type="DRAM", remote_mem_type=None, notif=b""):
        handle = post(op, src, dst, remote, mem_type, remote_mem_type, notif=notif)
        parsed = wire.parse_notif(notif)
        if parsed and parsed[1] == request_id and int(parsed[2]) >= from_layer:
            stuck.append(handle)
            posted.set()
        return handle

    def polling(handle):
        state = poll(handle)
        return "PROC" if any(handle is h for h in stuck) else state

    agent.post, agent.poll = posting, polling
    return posted


def stuck_write(s: Setup, request_id: str) -> None:
    """A request the test's receiver registered for, whose layer 0 WRITE is posted and never completes."""
    _, pages = _registered(s, request_id)
    posted = stick_writes(s.producer, request_id, 0)
    s.producer.layer_done(request_id, 0, pages, None)
    assert posted.wait(10), "layer 0's WRITE was never posted"


def wait_for(predicate, timeout_s: float) -> float:
    """Wait until ``predicate()`` holds (failing past ``timeout_s``); returns the monotonic time then."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
    return time.monotonic()


def test_abort_with_a_write_that_never_completes_does_not_stall_the_engine(loaded):
    T = 4.0  # the configured transfer timeout
    s = Setup(loaded, transfer_timeout_s=T, prefix_cache=False)
    calls = []  # (request id, engine lock held?, seconds) per producer.abort call
    abort = s.producer.abort

    def watched_abort(request_id, *args, **kwargs):
        locked, t = s.engine._lock.locked(), time.monotonic()
        try:
            return abort(request_id, *args, **kwargs)
        finally:
            calls.append((request_id, locked, time.monotonic() - t))

    s.producer.abort = watched_abort
    try:
        ids = loaded.tokenizer.encode("This WRITE never completes. " * 40)
        held, go, _ = hold_at_layer(s.producer, 3)
        posted = stick_writes(s.producer, "st", 3)
        fut = s.run("st", ids, list(range(-(-len(ids) // BS))))
        assert held.wait(120), "the streamed forward never reached layer 3"
        assert posted.wait(30), "layer 3's WRITE was never posted"
        staging = s.pool.num_used
        assert staging == s.pool.stream_blocks_needed(len(ids), 2)
        t0 = time.monotonic()
        assert s.engine.abort("st")  # e.g. the gateway saw the decode die
        go.set()
        with pytest.raises(RequestCancelled, match="st was aborted"):
            fut.result(timeout=T)
        t_failed = time.monotonic() - t0
        # the engine's abort returned at once (its short wait, not the transfer timeout), without its lock
        assert [(rid, locked) for rid, locked, _ in calls] == [("st", False)]
        assert calls[0][2] < 1.0 and t_failed < T / 2, (calls, t_failed)
        # the WRITE is still "in flight": its staging blocks stay held ...
        assert s.producer.state("st") is TransferState.SENDING and s.pool.num_used == staging
        # ... and meanwhile the engine serves another request, whole
        fut2 = s.run("ok", ids[:50], list(range(100, 104)))
        assert s.wait("ok") == "done"
        assert fut2.result(timeout=T).num_prompt_tokens == 50
        assert time.monotonic() - t0 < T
        assert s.producer.state("st") is TransferState.SENDING and s.pool.num_used == staging
        # the transfer timeout after the abort, the WRITE is given up: every block is back, the decode is told
        t_freed = wait_for(lambda: s.pool.num_used == 0, T + 10)
        assert T <= t_freed - t0 < T + 2.0, t_freed - t0
        assert s.producer.num_active == 0 and s.producer.state("st") is TransferState.FAILED
        assert "WRITEs still in flight after 4 s" in s.wait("st")
        assert s.producer.stats().aborted_total == 1
        assert [c[0] for c in calls] == ["st"]  # (the engine never called abort again for it)
    finally:
        s.close()


@pytest.fixture()
def stuck(loaded):
    """A Setup with a short transfer timeout (``T_SHORT``) and a request "sw" whose layer 0 WRITE
    never completes."""
    s = Setup(loaded, transfer_timeout_s=T_SHORT, prefix_cache=False)
    try:
        stuck_write(s, "sw")
        yield s
    finally:
        if s.producer._started:  # (unless the test closed it)
            s.close()


T_SHORT = 1.5


def test_producer_abort_returns_at_once_and_calls_back_when_the_write_is_given_up(stuck):
    s, idle, threads = stuck, threading.Event(), []

    def on_idle():
        threads.append(threading.current_thread().name)
        idle.set()

    t0 = time.monotonic()
    assert s.producer.abort("sw", "test abort", on_idle=on_idle)
    assert time.monotonic() - t0 < s.producer.abort_wait_s + 0.5
    assert not idle.is_set() and s.producer.num_active == 1  # the WRITE is still "in flight"
    assert s.producer.abort("sw", "again")  # (a second abort: the first one's deadline stands)
    assert idle.wait(T_SHORT + 5) and T_SHORT <= time.monotonic() - t0 < T_SHORT + 2.0
    assert threads == ["kv-producer-push"]  # called back once, by the producer's service thread
    assert s.producer.num_active == 0 and s.producer.state("sw") is TransferState.FAILED
    assert "WRITEs still in flight after 1.5 s" in s.wait("sw")
    # an unknown request: called back at once, False
    called = []
    assert not s.producer.abort("nobody", on_idle=lambda: called.append(1)) and called == [1]


def test_stop_ends_an_abort_whose_write_never_completes(stuck):
    called = []
    stuck.producer.abort("sw", on_idle=lambda: called.append(threading.current_thread().name))
    t0 = time.monotonic()
    stuck.close()  # stops the engine, then the producer: it waits for the abort (at most T_SHORT)
    assert called and time.monotonic() - t0 < T_SHORT + 2.0
    assert stuck.producer.num_active == 0


# ---- the setting ----
def test_transfer_timeout_setting_defaults_to_the_lease_and_rejects_nonsense(capsys):
    assert ConnectorConfig().transfer_timeout_for(EngineConfig().lease_ttl_s) == 30.0
    assert ConnectorConfig().transfer_timeout_for(12.0) == 12.0  # never longer than the lease by default
    assert ConnectorConfig(transfer_timeout_s=45.0).transfer_timeout_for(12.0) == 45.0  # set: as given
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--transfer-timeout must be a positive number"):
            ServerConfig(connector=ConnectorConfig(transfer_timeout_s=bad)).validate()
    for bad in ("0", "-5"):
        assert main(["serve", "--transfer-mode", "local", "--transfer-timeout", bad]) == 2
        assert "error: --transfer-timeout must be a positive number of seconds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--transfer-timeout SECONDS" in capsys.readouterr().out


def test_serve_passes_the_transfer_timeout_to_the_producer(monkeypatch):
    from prefill_server.serving import server

    monkeypatch.setenv("PREFILL_SERVER_SECRET", "test-secret-0123456789")
    facts = DecodeFacts(url="http://x", vllm_version="0.32.0", model="/m", served_model_name="m", block_size=BS)
    ecfg = EngineConfig(dtype="float32", num_kv_blocks=8, lease_ttl_s=20.0)
    for scfg, expected in ((ServerConfig(transfer_mode="connector", decode_urls=("http://x",)), 20.0),
                           (ServerConfig(transfer_mode="connector", decode_urls=("http://x",),
                                         connector=ConnectorConfig(transfer_timeout_s=7.5)), 7.5)):
        producer = server.build_service(ecfg, scfg, facts).worker.engine.producer
        assert producer.transfer_timeout_s == expected
        assert producer.pull.lease_ttl_s == 20.0


# ---- nothing waits on a request that is going away ----
def entered(producer, name: str, when) -> threading.Event:
    """An event set once ``producer.<name>`` is called with positional arguments ``when`` accepts."""
    ev, orig = threading.Event(), getattr(producer, name)

    def wrapped(*args, **kwargs):
        if when(*args):
            ev.set()
        return orig(*args, **kwargs)

    setattr(producer, name, wrapped)
    return ev


@pytest.mark.parametrize("where,how", [("wait_layer", "engine abort"), ("finish", "engine abort"),
                                       ("wait_layer", "decode cancel")])
def test_a_forward_waiting_on_a_write_that_never_completes_stops_at_once(loaded, where, how):
    """The forward waits for a WRITE that never completes, in ``wait_layer`` (a staging slot's
    previous layer) or in ``finish`` (the last layer); the request is aborted (the gateway) or
    its decode cancels it. The wait stops at once, not at the transfer timeout: the request
    fails, the engine serves another one meanwhile, and the staging blocks come back once the
    transfer timeout gives the WRITE up. (Before: the engine's loop sat in the wait for the
    whole transfer timeout.)"""
    T = 5.0
    s = Setup(loaded, transfer_timeout_s=T, prefix_cache=False)
    try:
        L = loaded.config.num_layers
        ids = loaded.tokenizer.encode("This WRITE never completes. " * 40)
        posted = stick_writes(s.producer, "sw", 0 if where == "wait_layer" else L - 1)
        waiting = entered(s.producer, where, lambda rid, *a: rid == "sw" and (where == "finish" or a[0] == 0))
        fut = s.run("sw", ids, list(range(-(-len(ids) // BS))))
        assert posted.wait(120) and waiting.wait(120), "the forward never waited on the stuck WRITE"
        time.sleep(0.3)
        assert not fut.done()  # it waits
        staging = s.pool.num_used
        assert staging == s.pool.stream_blocks_needed(len(ids), 2)
        t0 = time.monotonic()
        if how == "engine abort":
            assert s.engine.abort("sw")
            with pytest.raises(RequestCancelled, match="sw was aborted"):
                fut.result(timeout=T)
        else:
            s.receiver.cancel(s.producer.host, s.producer.port, "sw")
            with pytest.raises(TransferError, match="cancelled by the decode"):
                fut.result(timeout=T)
        t_failed = time.monotonic() - t0
        assert t_failed < 1.5, t_failed  # the producer's abort_wait_s (0.25 s) at most, plus the poll
        # the WRITE is still "in flight": its staging blocks stay held, and the engine serves on
        assert s.pool.num_used == staging
        fut2 = s.run("ok", ids[:50], list(range(100, 104)))
        assert s.wait("ok") == "done"
        assert fut2.result(timeout=T).num_prompt_tokens == 50
        assert time.monotonic() - t0 < T and s.pool.num_used == staging
        # the transfer timeout after the abort/Cancel, the WRITE is given up: every block is back
        t_freed = wait_for(lambda: s.pool.num_used == 0, T + 10)
        assert T <= t_freed - t0 < T + 2.0, t_freed - t0
        assert s.producer.num_active == 0
        if how == "engine abort":
            assert s.producer.state("sw") is TransferState.FAILED
            if where == "wait_layer":  # (in "finish", every layer's WRITE did land: the decode had them all)
                assert "WRITEs still in flight after 5 s" in s.wait("sw")
        else:  # the decode's Cancel is acknowledged once the WRITE is given up
            assert wait_for(lambda: "sw" in s.receiver.poll().cancelled, 5) - t0 >= T
            assert s.producer.state("sw") is TransferState.ABORTED
    finally:
        s.close()


def test_a_decode_cancel_waits_for_its_write_without_stalling_the_side_channel(loaded):
    """A decode cancels a request whose WRITE never completes: the Cancel is acknowledged only
    once the WRITE is over (given up at the transfer timeout), so the decode cannot reuse its
    blocks under a WRITE; meanwhile the side channel answers other decodes at once. (Before: the
    service thread waited in the Cancel for the whole transfer timeout.)"""
    T = 5.0
    s = Setup(loaded, transfer_timeout_s=T, prefix_cache=False)
    try:
        stuck_write(s, "sw")
        t0 = time.monotonic()
        s.receiver.cancel(s.producer.host, s.producer.port, "sw")
        time.sleep(0.2)  # (the Cancel is in)
        _registered(s, "other")  # another decode's Register is answered meanwhile
        assert time.monotonic() - t0 < 2.0
        assert "sw" not in s.receiver.poll().cancelled  # not acknowledged: the WRITE is in flight
        assert s.producer.state("sw") is TransferState.ABORTED
        t_ack = wait_for(lambda: "sw" in s.receiver.poll().cancelled, T + 5)
        assert T <= t_ack - t0 < T + 2.0, t_ack - t0
        assert s.producer.state("sw") is TransferState.ABORTED
        # a Cancel with nothing in flight is acknowledged at once
        t1 = time.monotonic()
        s.receiver.cancel(s.producer.host, s.producer.port, "other")
        wait_for(lambda: "other" in s.receiver.poll().cancelled, 5)
        assert time.monotonic() - t1 < 2.0 and s.producer.state("other") is TransferState.ABORTED
    finally:
        s.close()


# ---- the decode never reuses blocks a WRITE may still land in ----
class Outcomes:
    """What a receiver's ``poll()`` reported, gathered across calls (each result comes once)."""

    def __init__(self, receiver):
        self.receiver, self.cancelled, self.failed = receiver, {}, {}

    def update(self) -> None:
        r, now = self.receiver.poll(), time.monotonic()
        for rid in r.cancelled:
            self.cancelled.setdefault(rid, now)
        for rid, why in r.failed.items():
            self.failed.setdefault(rid, (now, why))


def test_a_decode_cancel_waits_past_its_rpc_timeout_for_the_prefill_to_give_the_write_up(loaded):
    """The prefill's transfer timeout (T) is longer than the decode's RPC timeout: the Cancel must
    wait for the prefill's Ack (sent once the stuck WRITE is given up, T after the Cancel), which
    the Register's Ack announced. (Before: the Cancel gave up at the RPC timeout and reported the
    request cancelled while the WRITE could still land in blocks vLLM would reuse.)"""
    T = 3.0
    s = Setup(loaded, transfer_timeout_s=T, prefix_cache=False)
    try:
        s.receiver.rpc_timeout_s = 0.5
        stuck_write(s, "sw")
        wait_for(lambda: s.receiver._recv["sw"].write_timeout_s == T, 5)  # (the Ack says T)
        assert s.receiver.cancel_wait_s(s.receiver._recv["sw"]) == T + 0.5
        seen = Outcomes(s.receiver)
        t0 = time.monotonic()
        s.receiver.cancel(s.producer.host, s.producer.port, "sw")
        while time.monotonic() - t0 < 1.5:  # well past the RPC timeout: not reported
            seen.update()
            time.sleep(0.01)
        assert "sw" not in seen.cancelled
        t_ack = wait_for(lambda: seen.update() or "sw" in seen.cancelled, T + 5)
        assert T <= t_ack - t0 < T + 0.5 + 0.5, t_ack - t0  # the Ack, not the Cancel's own timeout
        assert s.producer.state("sw") is TransferState.ABORTED
    finally:
        s.close()


def test_a_push_the_decode_gives_up_is_reported_failed_once_the_prefill_stops_writing(loaded):
    """No layer arrives within the decode's timeout (a WRITE is stuck): the decode cancels the
    request on the prefill and reports the failure (vLLM then frees the blocks) only once the
    prefill acknowledges, T after that Cancel. (Before: it reported the failure at once.)"""
    T = 3.0
    s = Setup(loaded, transfer_timeout_s=T, prefix_cache=False)
    try:
        s.receiver.timeout_s = 1.0  # (read when the request is registered)
        t0 = time.monotonic()
        stuck_write(s, "gw")
        seen = Outcomes(s.receiver)
        t_failed = wait_for(lambda: seen.update() or "gw" in seen.failed, 1.0 + T + 5)
        assert 1.0 + T <= t_failed - t0 < 1.0 + T + 1.5, t_failed - t0
        assert "no KV from the prefill server for 1 s" in seen.failed["gw"][1]
        assert "gw" not in seen.cancelled and s.receiver.pending() == 0
        assert s.producer.state("gw") is TransferState.ABORTED  # (the Cancel reached it)
    finally:
        s.close()


def test_a_prefill_that_died_is_given_up_without_the_long_waits(loaded):
    """Nothing listens on the prefill's port any more: a Cancel is reported at once (a dead
    process cannot write), and a push request registered there fails after the RPC timeout,
    not after a Cancel's long wait."""
    s = Setup(loaded)
    try:
        s.receiver.rpc_timeout_s = 0.5
        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        seen = Outcomes(s.receiver)
        t0 = time.monotonic()
        s.receiver.cancel("127.0.0.1", port, "gone")
        assert wait_for(lambda: seen.update() or "gone" in seen.cancelled, 5) - t0 < 1.0
        assert s.receiver.cancel_wait_s(None) == s.receiver.timeout_s + 0.5  # (what it did not wait)
        t1 = time.monotonic()
        s.receiver.register("127.0.0.1", port, "orphan", [0, 1], 0, 20)
        assert wait_for(lambda: seen.update() or "orphan" in seen.failed, 5) - t1 < 2.0
        assert "did not answer within 0.5 s" in seen.failed["orphan"][1]
        assert s.receiver.pending() == 0
    finally:
        s.close()


def test_a_cancel_waiting_on_a_prefill_that_then_dies_is_reported_once_its_port_refuses(loaded):
    """The prefill's port listened when the Cancel went out (so it waits for an answer), then
    the process died: the wait re-checks the port and reports the cancel within about a second,
    not after the write timeout plus the RPC timeout (30 s here)."""
    s = Setup(loaded)
    listener = socket.create_server(("127.0.0.1", 0))  # accepts at the TCP level, never answers
    try:
        port = listener.getsockname()[1]
        seen = Outcomes(s.receiver)
        s.receiver.cancel("127.0.0.1", port, "dies")
        time.sleep(0.5)
        assert not (seen.update() or "dies" in seen.cancelled)  # (waiting: the port listens)
        listener.close()
        t0 = time.monotonic()
        assert wait_for(lambda: seen.update() or "dies" in seen.cancelled, 10) - t0 < 1.0 + REPROBE_S
    finally:
        listener.close()
        s.close()


def test_close_ends_a_cancel_that_waits_for_an_answer(loaded):
    """The decode shuts down while a Cancel waits (a prefill that never answers): close() returns
    at once rather than after the Cancel's wait (the CI failure of 2026-12-01: 6.3 s)."""
    s = Setup(loaded)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        s.receiver.cancel("127.0.0.1", listener.getsockname()[1], "waits")
        time.sleep(0.3)
        t0 = time.monotonic()
        s.close()
        assert time.monotonic() - t0 < 1.0
    finally:
        listener.close()

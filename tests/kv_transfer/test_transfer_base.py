"""kv_transfer.base: the state enum, the stats holder and the producer contract."""
from __future__ import annotations

import threading

import pytest

from kv_transfer.base import Route, StatsCounter, TransferState, check_request_id
from prefill_server.errors import InvalidRequest
from kv_transfer.vllm.nixl_compat import NixlCompatProducer


def test_terminal_states():
    assert {s for s in TransferState if s.is_terminal} == {
        TransferState.RELEASED, TransferState.EXPIRED, TransferState.ABORTED, TransferState.FAILED}


def test_stats_counter_is_thread_safe():
    c = StatsCounter()
    threads = [threading.Thread(target=lambda: [c.add(notifications_total=1) for _ in range(1000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.set(active_leases=3)
    s = c.snapshot()
    assert s.notifications_total == 4000 and s.as_dict()["active_leases"] == 3
    c.add(notifications_total=1)
    assert s.notifications_total == 4000  # snapshots do not change


def test_producer_contract():
    """Each producer says which routes it serves; the one request-id rule."""
    from kv_transfer.push import PushProducer
    from prefill_server.engine.local_producer import LocalProducer

    assert NixlCompatProducer.routes == LocalProducer.routes == {Route.LEASE}
    assert PushProducer.routes == {Route.STREAM, Route.LEASE_FOR_LATER}
    assert Route.STREAM.registers and Route.STREAM_THEN_PULL.registers and not Route.LEASE_FOR_LATER.registers
    for ok in ("pf-0123", "a" * 200, "___prefill_addr_10.0.0.1:8000___decode_addr_h:1_abc", "cmpl-x.y_z"):
        check_request_id(ok)
    for bad in ("", "a" * 201, "HB:x", "a,b", "a b", "é", 42, None):
        with pytest.raises(InvalidRequest, match="request id"):
            check_request_id(bad)

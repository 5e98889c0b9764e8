"""kv_transfer.base: the state enum, the stats holder and the producer contract."""
from __future__ import annotations

import threading

import pytest

from kv_transfer.base import KVProducer, StatsCounter, StreamingKVProducer, TransferMode, TransferState
from kv_transfer.vllm.v0_32 import NixlCompatProducer


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
    with pytest.raises(TypeError):
        KVProducer()  # abstract
    assert issubclass(NixlCompatProducer, KVProducer) and NixlCompatProducer.mode is TransferMode.PULL
    assert not isinstance(object(), StreamingKVProducer)

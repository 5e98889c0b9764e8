"""Streaming push (connector mode): the prefill WRITEs each layer's KV into the decode's own blocks
as soon as that layer is computed. One job per module:

    producer.py      PushProducer: the request registry, the engine-facing API, the service thread
    writer.py        LayerWriter: the WRITE job queue, the poster thread, handles, waits, give-up
    side_channel.py  SignedSideChannel: the socket, authentication, replay, refusals

The decode side is ``kv_transfer.vllm.connector`` (``kv_transfer.receiver``); the messages are
``kv_transfer.wire``; the pull fallback's leases ``kv_transfer.pull``.
"""
from kv_transfer.push.producer import PushProducer

__all__ = ["PushProducer"]

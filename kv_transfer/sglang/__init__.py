"""Unmodified SGLang decodes behind this prefill server (PD disaggregation, NIXL backend). One module
per pinned SGLang version holds its wire (``v0_5_23``); the rest is shared:

    producer.py   SGLangProducer: the room registry, the engine-facing API, the service thread
    bootstrap.py  the bootstrap HTTP server (PUT/GET /route, /health) and its rank table
    control.py    the ZMQ sockets: our PULL (decode messages), PUSH to decodes (status, ABORT_ACK)
    peers.py      decode registrations and transfer infos checked against our KV geometry
    target.py     the layer conversion into SGLang's layout and the aux rows (a LayerWriter target)
"""
from kv_transfer.sglang.producer import SGLangProducer

__all__ = ["SGLangProducer"]

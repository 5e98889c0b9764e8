"""A decode stand-in in its own process (for tests that kill it): a PushReceiver with fresh caches
that registers one request, prints "registered", then waits to be killed.

    python receiver_proc.py '{"geometry": {...}, "secret": "...", "host": ..., "port": ...,
                              "request_id": ..., "num_tokens": ..., "num_blocks": ...}'
"""
import json
import sys
import time

import msgspec
import torch

from kv_transfer import wire
from kv_transfer.receiver import PushReceiver


def main() -> None:
    a = json.loads(sys.argv[1])
    g = msgspec.convert(a["geometry"], wire.Geometry)
    caches = [torch.zeros(a["num_blocks"], g.num_kv_heads, g.block_size, 2 * g.head_dim)
              for _ in range(g.num_layers)]
    r = PushReceiver(caches, g, a["secret"].encode(), timeout_s=600)
    r.register(a["host"], a["port"], a["request_id"], list(range(a["num_blocks"])), 0, a["num_tokens"])
    print("registered", flush=True)
    while True:
        r.poll()
        time.sleep(0.01)


if __name__ == "__main__":
    main()

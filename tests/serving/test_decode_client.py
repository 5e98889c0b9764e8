"""The gateway's HTTP client to a decode (serving/decode_client.py): its idle connections end before
a vLLM server closes them, and it never queues answers in flight behind a connection cap."""
from __future__ import annotations

import asyncio
import pathlib
import re
import time

import pytest

from fake_decode import FakeDecode
from prefill_server.serving.decode_client import KEEPALIVE_S, DecodeClient

VLLM_ENVS = pathlib.Path(__file__).resolve().parents[2] / ".venv-vllm/lib/python3.11/site-packages/vllm/envs.py"


def test_idle_connections_end_before_the_decode_closes_them():
    """A request sent on a connection the decode is closing at that moment fails though the decode
    is up: the client drops idle connections well before vLLM's keep-alive runs out."""
    if not VLLM_ENVS.exists():
        pytest.skip("no vLLM decode venv (.venv-vllm) to read its keep-alive from")
    m = re.search(r'"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": lambda: int\(\s*os\.environ\.get\(\s*'
                  r'"VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "(\d+)"', VLLM_ENVS.read_text())
    assert m, "vLLM's keep-alive default moved: read it again"
    assert KEEPALIVE_S <= int(m.group(1)) / 2


def test_many_answers_in_flight_are_not_queued_behind_each_other():
    """150 requests at once to a decode that takes 2 s for each: all in about 2 s (httpx's default
    cap of 100 connections would hold the last 50 for two seconds more)."""
    with FakeDecode(delay_s=2.0) as decode:
        async def main() -> float:
            client = DecodeClient(decode.url, 30.0)
            t0 = time.monotonic()
            rs = await asyncio.gather(*(client.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
                                        for _ in range(150)))
            took = time.monotonic() - t0
            await client.close()
            assert all(r.status_code == 200 for r in rs)
            return took
        took = asyncio.run(main())
    assert took < 3.5, took  # (a slow CI machine's overhead is well under 1.5 s; queued: >= 4 s)

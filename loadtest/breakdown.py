"""Where a run's mean request time went: queue, prefill, the rest of the way to the first token,
and the decode (the rest of the answer); the KV transfer beside them, since it overlaps the last two.

The server exposes no per-request timings over HTTP, so for HTTP runs the server's phases are the
means of its ``/metrics`` histograms over the run (scraped before and after: ``promscrape``),
and the client's means give the rest. gRPC answers carry each request's own timings, which are
used instead. Means, not medians, because only means add up: queue + prefill + to_first_token is
the client's mean TTFT, and that + decode its mean end-to-end latency.

Sources of queue and prefill, first found wins:
- ``grpc``: the ``timings`` of each successful gRPC answer (``PrefillResult.timings``);
- ``prefill_server``: ``prefill_server:queue_seconds`` and ``prefill_server:prefill_seconds``;
- ``vllm``: ``vllm:request_queue_time_seconds`` and ``vllm:request_prefill_time_seconds`` (a vLLM
  target, as in baseline mode, prefilling itself);
- ``client``: none: the bar is TTFT and decode only.
The server's histograms count every request it saw, failed and cancelled ones too, while the client
means are over successful requests: with many errors the split is approximate.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

_PHASES = {"prefill_server": ("prefill_server:queue_seconds", "prefill_server:prefill_seconds"),
           "vllm": ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds")}
KV_TRANSFER = "prefill_server:kv_transfer_seconds"


@dataclass(frozen=True)
class Breakdown:
    source: str  # grpc | prefill_server | vllm | client
    queue_s: float | None  # waiting for the engine
    prefill_s: float | None  # computing the prompt's KV (the first token with it)
    to_first_token_s: float | None  # client TTFT beyond queue + prefill: tokenize, HTTP, the decode's
    #                                 KV pull and first step, the first chunk's way back
    decode_s: float | None  # client end-to-end beyond the TTFT: the other tokens
    kv_transfer_s: float | None  # KV published -> lease released (pull: the decode has read it)
    client_ttft_s: float | None
    client_e2e_s: float | None


def _mean(d: dict | None, *path) -> float | None:
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
    return d if isinstance(d, (int, float)) else None


def compute(summary: dict, server: dict) -> dict:
    """The breakdown of one run (its ``summary`` from ``stats`` and ``server`` from ``promscrape``)."""
    hist = (server or {}).get("histograms") or {}
    ttft, e2e = _mean(summary, "ttft_s", "mean"), _mean(summary, "e2e_s", "mean")
    queue = prefill = None
    source = "client"
    timings = summary.get("server_timings_s") or {}
    if _mean(timings, "prefill_s", "mean") is not None:
        source, queue, prefill = "grpc", _mean(timings, "queue_s", "mean"), _mean(timings, "prefill_s", "mean")
    else:
        for name, (q, p) in _PHASES.items():
            if _mean(hist, p, "mean") is not None:
                source, queue, prefill = name, _mean(hist, q, "mean"), _mean(hist, p, "mean")
                break
    server_part = (queue or 0.0) + (prefill or 0.0)
    rest = None if ttft is None else (ttft if source == "client" else max(0.0, ttft - server_part))
    decode = None if ttft is None or e2e is None else max(0.0, e2e - ttft)
    return asdict(Breakdown(source, queue, prefill, rest, decode, _mean(hist, KV_TRANSFER, "mean"), ttft, e2e))

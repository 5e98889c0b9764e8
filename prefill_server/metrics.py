"""Prometheus metrics, named like the ecosystem's (vLLM's ``vllm:...`` -> ``prefill_server:...``)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TOKENIZE_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "prefill_server:"
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Request arrival to first token (prefill done, KV published)",
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.prefill_time = Histogram(p + "prefill_seconds", "Time computing a request's prefill",
                                      registry=r, buckets=_LATENCY_BUCKETS)
        self.queue_time = Histogram(p + "queue_seconds", "Time waiting before the first chunk",
                                    registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e_time = Histogram(p + "e2e_request_latency_seconds", "Gateway request latency incl. decode",
                                  registry=r, buckets=_LATENCY_BUCKETS)
        self.kv_bytes = Counter(p + "kv_transfer_bytes_total", "KV bytes made available to / sent to decoders",
                                registry=r)
        self.kv_transfer_time = Histogram(p + "kv_transfer_seconds",
                                          "KV published -> lease released (pull: the decode has read it)",
                                          registry=r, buckets=_LATENCY_BUCKETS)
        self.kv_failed = Counter(p + "kv_transfer_failed_total", "Transfers that failed or were aborted",
                                 registry=r)
        self.lease_expired = Counter(p + "kv_lease_expired_total", "KV leases freed by expiry", registry=r)
        self.blocks_in_use = Gauge(p + "kv_blocks_in_use", "KV pool blocks allocated", registry=r)
        self.blocks_total = Gauge(p + "kv_blocks_total", "KV pool blocks", registry=r)
        self.queue_depth = Gauge(p + "num_requests_waiting", "Requests waiting for the engine", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests being prefilled", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens prefilled", registry=r)
        self.first_token = Counter(p + "first_token_total", "Gateway requests by who sampled the "
                                   "first token: prefill (greedy, --first-token prefill) or decode",
                                   ["sampled_by"], registry=r)
        self.requests = Counter(p + "requests_total", "API requests (HTTP, gRPC) finished, by outcome: ok "
                                "(answered end to end, the decode's answer included), cancelled (the client "
                                "went away), or the error's class", ["outcome"], registry=r)
        self.prefills = Counter(p + "prefills_total", "Engine prefills finished, by outcome: ok (KV "
                                "published or streamed) or the error's class", ["outcome"], registry=r)
        self.decode_up = Gauge(p + "decode_up", "1 while the decode answers its health check (gateway)",
                               ["decode"], registry=r)
        self.decode_outstanding = Gauge(p + "decode_requests_outstanding", "Requests sent to the decode and "
                                        "not finished (gateway)", ["decode"], registry=r)
        # the prefix cache (vLLM's vllm:prefix_cache_queries / _hits, in tokens): hit rate = hits / queries
        self.prefix_cache_queries = Counter(p + "prefix_cache_queries_total", "Prompt tokens looked up in the "
                                            "prefix cache", registry=r)
        self.prefix_cache_hits = Counter(p + "prefix_cache_hits_total", "Prompt tokens found in the prefix "
                                         "cache (not computed)", registry=r)
        self.prefix_cache_blocks = Gauge(p + "prefix_cache_blocks", "KV blocks named in the prefix cache "
                                         "(in use or evictable)", registry=r)
        self.prefix_cache_evictions = Counter(p + "prefix_cache_evictions_total", "Cached KV blocks evicted "
                                              "(least recently used, unreferenced) to make room", registry=r)
        self.prefix_cache_host_blocks = Gauge(p + "prefix_cache_host_blocks", "Evicted KV blocks kept in the "
                                              "host tier (--host-cache-gib)", registry=r)
        self.prefix_cache_host_restored = Counter(p + "prefix_cache_host_restored_total", "KV blocks brought "
                                                  "back from the host tier for a prompt (hits)", registry=r)

        self.tokenize_remote = Histogram(p + "tokenize_remote_seconds", "A prompt tokenized by the decode's "
                                         "/tokenize (--tokenizer-parity decode), round trip", registry=r,
                                         buckets=_TOKENIZE_BUCKETS)
        self.tokenize_remote_failed = Counter(p + "tokenize_remote_failed_total", "Prompts the decode's /tokenize "
                                              "could not tokenize (unreachable or failed)", registry=r)
        self.tokenizer_parity = Gauge(p + "tokenizer_parity", "1 when the decode tokenized the start-up probe "
                                      "as this server does, 0 when it differed or could not be asked",
                                      ["decode"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def escape_label(v: str) -> str:
    """A Prometheus label value, escaped for the text exposition format."""
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

"""The server's own numbers: ``GET /metrics`` (Prometheus text) before and after a run, and their
deltas: histograms as count, sum, mean and quantiles estimated from the buckets (as Prometheus'
``histogram_quantile``: linear within a bucket), counters by label, gauges at the end.

Series of one name with different labels (vLLM's ``model_name``, ``engine``) are summed, except
the labels named in ``BY_LABEL`` (``outcome``, ...), which are kept apart.
"""
from __future__ import annotations

import asyncio
import math
import re
import time

import httpx

HISTOGRAMS = ("prefill_server:queue_seconds", "prefill_server:prefill_seconds",
              "prefill_server:time_to_first_token_seconds", "prefill_server:kv_transfer_seconds",
              "prefill_server:e2e_request_latency_seconds",
              # a vLLM target (baseline): its own breakdown, when it exports these
              "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
COUNTERS = ("prefill_server:requests_total", "prefill_server:prefills_total",
            "prefill_server:prompt_tokens_total", "prefill_server:kv_transfer_failed_total",
            "prefill_server:kv_lease_expired_total", "prefill_server:first_token_total",
            "prefill_server:kv_transfer_bytes_total", "vllm:request_success_total", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total")
GAUGES = ("prefill_server:kv_blocks_in_use", "prefill_server:kv_blocks_total",
          "prefill_server:num_requests_waiting", "prefill_server:num_requests_running",
          "prefill_server:decode_up")
BY_LABEL = ("outcome", "sampled_by", "finished_reason")
BLOCKS_IN_USE = "prefill_server:kv_blocks_in_use"

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict  # (name, ((label, value), ...)) -> float


def parse(text: str) -> Samples:
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            continue
    return out


async def scrape(client: httpx.AsyncClient, base_url: str, headers: dict | None = None) -> tuple[Samples | None, str | None]:
    """(samples, None), or (None, why not)."""
    try:
        r = await client.get(base_url + "/metrics", headers=headers or {}, timeout=30)
    except (httpx.HTTPError, OSError) as e:
        return None, f"{type(e).__name__}: {e}"
    if r.status_code != 200:
        return None, f"GET /metrics answered {r.status_code}"
    return parse(r.text), None


def _activity(s: Samples) -> dict:
    """The samples that move while the server still finishes requests: counters and histogram counts."""
    names = set(COUNTERS) | {h + "_count" for h in HISTOGRAMS}
    return {k: v for k, v in s.items() if k[0] in names}


async def scrape_settled(client: httpx.AsyncClient, base_url: str, headers: dict | None = None, *,
                         every_s: float = 0.25, timeout_s: float = 5.0) -> tuple[Samples | None, str | None]:
    """A scrape once the server's counters stop moving (two scrapes ``every_s`` apart agree), or
    the last one after ``timeout_s``. The client sees a stream's [DONE] a moment before the server
    counts that request (and a lease ends after the decode's read): an immediate scrape misses it."""
    t_end = time.perf_counter() + timeout_s
    last, err = await scrape(client, base_url, headers)
    while last is not None and time.perf_counter() < t_end:
        await asyncio.sleep(every_s)
        now, err = await scrape(client, base_url, headers)
        if now is None:
            break
        settled = _activity(now) == _activity(last)
        last = now
        if settled:
            break
    return last, (None if last is not None else err)


def _sum(s: Samples, name: str, keep: tuple = (), where: dict | None = None) -> dict[tuple, float]:
    """name's samples summed over every label but ``keep`` (and those filtered by ``where``)."""
    out: dict[tuple, float] = {}
    for (n, labels), v in s.items():
        if n != name:
            continue
        d = dict(labels)
        if where and any(d.get(k) != val for k, val in where.items()):
            continue
        key = tuple((k, d[k]) for k in keep if k in d)
        out[key] = out.get(key, 0.0) + v
    return out


def value(s: Samples, name: str) -> float | None:
    v = _sum(s, name)
    return v.get((), None) if v else None


def _hist(before: Samples, after: Samples, name: str) -> dict | None:
    def get(s, suffix, keep=()):
        return _sum(s, name + suffix, keep) if s else {}
    count_a = get(after, "_count").get(())
    if count_a is None:
        return None
    count = count_a - get(before, "_count").get((), 0.0)
    total = get(after, "_sum").get((), 0.0) - get(before, "_sum").get((), 0.0)
    ba, bb = get(after, "_bucket", ("le",)), get(before, "_bucket", ("le",))
    buckets = sorted(((float(k[0][1]), v - bb.get(k, 0.0)) for k, v in ba.items()), key=lambda x: x[0])
    out = {"count": count, "sum": total, "mean": total / count if count > 0 else None}
    for q in (50, 90, 99):
        out[f"p{q}_est"] = bucket_quantile(buckets, q / 100) if count > 0 else None
    return out


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Cumulative buckets [(le, count)] -> the q-quantile, linear within the bucket it falls in."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, prev_le, prev_c = q * buckets[-1][1], 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le  # in the +Inf bucket: the highest finite bound, as Prometheus does
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1.0)
        prev_le, prev_c = le, c
    return None


def deltas(before: Samples | None, after: Samples | None) -> dict:
    """What a run changed on the server: histograms, counters by label, and gauges at the end."""
    if after is None:
        return {}
    before = before or {}
    hists = {n: h for n in HISTOGRAMS if (h := _hist(before, after, n)) is not None}
    counters = {}
    for n in COUNTERS:
        keep = tuple(k for k in BY_LABEL if any(n == name and k in dict(lab) for name, lab in after))
        a = _sum(after, n, keep)
        if not a:
            continue
        b = _sum(before, n, keep)
        d = {",".join(f"{k}={v}" for k, v in key) or "total": v - b.get(key, 0.0) for key, v in a.items()}
        counters[n] = dict(sorted(d.items()))
    gauges = {n: v for n in GAUGES if (v := value(after, n)) is not None}
    return {"histograms": hists, "counters": counters, "gauges_at_end": gauges}

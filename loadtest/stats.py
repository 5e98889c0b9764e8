"""Summaries of a run's records: percentiles (linear interpolation between closest ranks, as
numpy's default), throughput, goodput under SLOs, errors by kind.

Definitions (``docs/loadtest.md`` repeats them):
- TTFT: request sent -> first non-empty streamed token (non-streamed requests: the whole answer,
  which is when their first token reaches the client);
- ITL: gaps between consecutive streamed chunks with text, pooled over all successful requests;
  TPOT: per request, the mean of its gaps;
- E2E: request sent -> answer complete;
- goodput: successful requests whose TTFT <= ``slo_ttft_s`` and whose ITL (its mean, or its max
  with ``itl_stat="max"``) <= ``slo_itl_s``, per second of the run (a request without gaps meets
  the ITL SLO);
- throughput: output (completion) tokens and prompt tokens of successful requests per second;
- time to 429: request sent -> its 429 answer (the last attempt's, with retries);
- send lag: planned send time -> actual send time.
"""
from __future__ import annotations

import math
from collections import Counter

OK = "ok"


def percentile(xs, q: float) -> float | None:
    """q in [0, 100]; linear interpolation; None for no data."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist(xs) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "min": min(xs), "max": max(xs)}


def _itl_value(r: dict, itl_stat: str) -> float | None:
    gaps = r.get("itl_s") or []
    if not gaps:
        return None
    return max(gaps) if itl_stat == "max" else sum(gaps) / len(gaps)


def meets_slo(r: dict, slo_ttft_s: float | None, slo_itl_s: float | None, itl_stat: str = "mean") -> bool:
    if r.get("status") != OK:
        return False
    if slo_ttft_s is not None and (r.get("ttft_s") is None or r["ttft_s"] > slo_ttft_s):
        return False
    itl = _itl_value(r, itl_stat)
    return not (slo_itl_s is not None and itl is not None and itl > slo_itl_s)


def summarize(records: list[dict], duration_s: float, *, slo_ttft_s: float | None = None,
              slo_itl_s: float | None = None, itl_stat: str = "mean") -> dict:
    ok = [r for r in records if r.get("status") == OK]
    dur = max(duration_s, 1e-9)
    kinds = Counter(r.get("status") or "unknown" for r in records)
    http = Counter(str(r["http_status"]) for r in records if r.get("http_status") is not None)
    sends = sorted(r["sent_s"] for r in records if r.get("sent_s") is not None)
    good = [r for r in ok if meets_slo(r, slo_ttft_s, slo_itl_s, itl_stat)]
    needles = [r for r in records if r.get("expect") is not None and r.get("status") == OK]
    out_tokens = sum(r.get("output_tokens") or 0 for r in ok)
    prompt_tokens = sum(r.get("prompt_tokens") or r.get("prompt_tokens_approx") or 0 for r in ok)
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok) - kinds.get("aborted", 0),
        "aborted": kinds.get("aborted", 0),
        "by_kind": dict(sorted(kinds.items())), "by_http_status": dict(sorted(http.items())),
        "retry_after_s": dist([r.get("retry_after_s") for r in records if r.get("status") == "http_429"]),
        # the generator's own lateness (a starved client, a full --max-concurrency, an agent turn waiting
        # for the previous one): large values mean the offered load was not the one asked for
        "send_lag_s": dist([r["sent_s"] - r["scheduled_s"] for r in records
                            if r.get("sent_s") is not None and r.get("scheduled_s") is not None]),
        # how fast an overloaded server says no (admission control should answer at once)
        "time_to_429_s": dist([r["end_s"] - r["sent_s"] for r in records if r.get("status") == "http_429"
                               and r.get("end_s") is not None and r.get("sent_s") is not None]),
        "duration_s": duration_s,
        "offered_rate_rps": (len(sends) - 1) / (sends[-1] - sends[0]) if len(sends) > 1 and sends[-1] > sends[0]
        else None,
        "request_throughput_rps": len(ok) / dur,
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / dur,
        "prompt_tokens": prompt_tokens, "prompt_tokens_per_s": prompt_tokens / dur,
        "ttft_s": dist(r.get("ttft_s") for r in ok),
        "itl_s": dist(g for r in ok for g in (r.get("itl_s") or ())),
        "tpot_s": dist(_itl_value(r, "mean") for r in ok),
        "e2e_s": dist(r.get("e2e_s") for r in ok),
        "slo": {"ttft_s": slo_ttft_s, "itl_s": slo_itl_s, "itl_stat": itl_stat},
        "goodput": {"requests": len(good), "rps": len(good) / dur,
                    "share_of_ok": len(good) / len(ok) if ok else None,
                    "share_of_all": len(good) / len(records) if records else None},
        "needle": {"checked": len(needles), "correct": sum(bool(r.get("answer_ok")) for r in needles),
                   "accuracy": (sum(bool(r.get("answer_ok")) for r in needles) / len(needles)) if needles
                   else None},
        "server_timings_s": {k: dist((r.get("server_timings") or {}).get(k) for r in ok)
                             for k in ("queue_s", "prefill_s", "total_s")
                             if any((r.get("server_timings") or {}).get(k) is not None for r in ok)},
    }

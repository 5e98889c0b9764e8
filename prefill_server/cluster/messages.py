"""What crosses between the gateway and a pool worker, as plain data (dicts of str, int, float, list):
the worker's process may run another version of nothing but these shapes, and KV never passes here
(a worker hands its KV to the decode itself; only ``kv_transfer_params`` come back).

A worker's ``run(request)`` streams events, each a dict with ``"event"``:

    accepted   {"worker": id}                     the worker took the request (release goes there)
    params     {"params": {...}}                  route STREAM: kv_transfer_params for the decode, at once
    progress   {"state": "queued"|"running", "requests_ahead": n, "tokens_done": n}
    alive      {}                                 nothing new, the worker is there (a heartbeat)
    result     {"result": {...}}                  the PrefillResult; the stream ends
    error      {"kind": class name, "message", "field", "retry_after_s"}; the stream ends
"""
from __future__ import annotations

from typing import Any

from kv_transfer.base import Route
from prefill_server.engine.types import PrefillRequest, PrefillResult, SamplingParams, Timings, WorkerLoad
from prefill_server.engine.worker import Progress
from prefill_server.errors import PrefillError, error_from


def request_to_dict(r: PrefillRequest) -> dict[str, Any]:
    s = r.sampling
    return {"request_id": r.request_id, "prompt_token_ids": list(r.prompt_token_ids),
            "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
                         "min_p": s.min_p, "repetition_penalty": s.repetition_penalty,
                         "logit_bias": [[t, b] for t, b in s.logit_bias],
                         "allowed_token_ids": None if s.allowed_token_ids is None else list(s.allowed_token_ids),
                         "banned_token_ids": list(s.banned_token_ids), "sampler": s.sampler},
            "route": r.route.value, "num_logprobs": r.num_logprobs, "room_tokens": r.room_tokens,
            "decode_url": r.decode_url, "cache_salt": r.cache_salt}


def request_from_dict(d: dict[str, Any]) -> PrefillRequest:
    s = dict(d["sampling"])
    s["logit_bias"] = tuple((int(t), float(b)) for t, b in s.get("logit_bias", ()))
    s["allowed_token_ids"] = None if s.get("allowed_token_ids") is None else tuple(int(t) for t in s["allowed_token_ids"])
    s["banned_token_ids"] = tuple(int(t) for t in s.get("banned_token_ids", ()))
    return PrefillRequest(str(d["request_id"]), tuple(int(t) for t in d["prompt_token_ids"]),
                          SamplingParams(**s), route=Route(d["route"]), num_logprobs=d["num_logprobs"],
                          room_tokens=int(d["room_tokens"]), decode_url=d["decode_url"],
                          cache_salt=d.get("cache_salt"))


def result_to_dict(r: PrefillResult) -> dict[str, Any]:
    return {"request_id": r.request_id, "first_token_id": r.first_token_id, "num_prompt_tokens": r.num_prompt_tokens,
            "num_cached_tokens": r.num_cached_tokens, "kv_transfer_params": r.kv_transfer_params,
            "timings": r.timings.as_dict(),
            "first_logprobs": None if r.first_logprobs is None else [list(p) for p in r.first_logprobs]}


def result_from_dict(d: dict[str, Any]) -> PrefillResult:
    lp = d["first_logprobs"]
    return PrefillResult(d["request_id"], d["first_token_id"], d["num_prompt_tokens"], d["num_cached_tokens"],
                         d["kv_transfer_params"], Timings(**d["timings"]),
                         None if lp is None else tuple((int(t), float(x)) for t, x in lp))


def error_event(e: BaseException) -> dict[str, Any]:
    if isinstance(e, PrefillError):
        return {"event": "error", "kind": type(e).__name__, "message": e.message, "field": e.field,
                "retry_after_s": e.retry_after_s}
    return {"event": "error", "kind": "PrefillError", "message": f"the prefill failed ({type(e).__name__}: {e})",
            "field": None, "retry_after_s": None}


def error_from_event(ev: dict[str, Any]) -> PrefillError:
    return error_from(ev["kind"], ev["message"], ev.get("field"), ev.get("retry_after_s"))


def progress_event(p: Progress) -> dict[str, Any]:
    return {"event": "progress", "state": p.state, "requests_ahead": p.requests_ahead, "tokens_done": p.tokens_done}


def progress_from_event(ev: dict[str, Any]) -> Progress:
    return Progress(ev["state"], requests_ahead=ev["requests_ahead"], tokens_done=ev["tokens_done"])


def load_to_dict(w: WorkerLoad) -> dict[str, Any]:
    return {"waiting": w.waiting, "running": w.running, "pending_tokens": w.pending_tokens,
            "free_blocks": w.free_blocks, "total_blocks": w.total_blocks, "block_size": w.block_size,
            "tokens_per_s": w.tokens_per_s}


def load_from_dict(d: dict[str, Any]) -> WorkerLoad:
    return WorkerLoad(**d)

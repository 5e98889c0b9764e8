"""Answering as SGLang's *prefill* behind ``sglang-router --pd-disaggregation`` (or any client that
speaks SGLang's PD protocol), with ``--decode-engine sglang``.

The router sends the client's request to the prefill and to the decode at once, both with
``bootstrap_host``, ``bootstrap_port`` (what its ``--prefill URL PORT`` names: our bootstrap
server's) and ``bootstrap_room``. The decode finds us through the bootstrap server, pre-allocates
its pages and sends the room's transfer info; we stream each layer into them as it is computed,
then the aux row (our first token) and the room's status (``kv_transfer/sglang/``). Our own answer
is the first token, as an SGLang prefill's is; the router answers the client with the decode's.

This module reads and checks those fields; the gateway runs the prefill (``gateway.py``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from prefill_server.engine.worker import SamplingParams
from prefill_server.errors import InvalidRequest
from prefill_server.serving import first_draw

MAX_ROOM = 2**63 - 1  # rooms are SGLang's 63-bit ints; 0 never completes on its decode
TOP_K_ALL = 1 << 30  # SGLang's "top_k off"


def room_of(raw: dict, bootstrap_port: int | None) -> int | None:
    """The request's ``bootstrap_room``, checked; None when it carries none (not a PD request).
    ``bootstrap_port``: ours (None: this server prefills for vLLM decodes and takes no rooms; 0: any)."""
    room = raw.get("bootstrap_room")
    if room is None:
        for key in ("bootstrap_host", "bootstrap_port"):
            if raw.get(key) is not None:
                raise InvalidRequest(f"'{key}' without 'bootstrap_room': SGLang's PD protocol sends all three "
                                     "(sglang-router does); add the room or drop the field", field="bootstrap_room")
        return None
    if bootstrap_port is None:
        raise InvalidRequest("this request carries bootstrap_room (SGLang's PD protocol, as sglang-router "
                             "--pd-disaggregation sends it), but this server prefills for vLLM decodes: start it "
                             "with --decode-engine sglang", field="bootstrap_room")
    if isinstance(room, list):
        raise InvalidRequest("bootstrap_room is a list (a batch of prompts): send one prompt per request",
                             field="bootstrap_room")
    if not isinstance(room, int) or isinstance(room, bool) or not 1 <= room <= MAX_ROOM:
        raise InvalidRequest(f"bootstrap_room must be an integer in 1..2^63-1, not {json.dumps(room)[:40]}",
                             field="bootstrap_room")
    port = raw.get("bootstrap_port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or (bootstrap_port and port != bootstrap_port)):
        raise InvalidRequest(f"bootstrap_port {json.dumps(port)[:20]} is not this server's bootstrap port "
                             f"{bootstrap_port}: the decode would look for the KV elsewhere; give the router "
                             f"--prefill <this server's URL> {bootstrap_port}", field="bootstrap_port")
    return room


def requested_logprobs(path: str, raw: dict) -> int | None:
    """The first token's logprobs a request to ``path`` asks for (None: none; k: the sampled one and
    the top k), which the decode reads from the aux row."""
    if path.endswith("/chat/completions"):
        return (raw.get("top_logprobs") or 0) if raw.get("logprobs") is True else None
    if path.endswith("/generate"):
        k = (raw.get("top_logprobs_num") or 0) if raw.get("return_logprob") is True else None
    else:
        k = raw.get("logprobs")
    return k if isinstance(k, int) and not isinstance(k, bool) else None


def rooms_in(raw: object) -> list[int]:
    """Every well-formed room a request names (a batch names several): the rooms to fail on their
    decode when the request is refused here."""
    room = raw.get("bootstrap_room") if isinstance(raw, dict) else None
    rooms = room if isinstance(room, list) else [room]
    return [r for r in rooms if isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= MAX_ROOM]


# with an SGLang decode the first token is always ours: what our sampler does not apply is refused
_WHO = "this prefill (with SGLang decodes the first token is its own)"


def check_sampling(fields: dict, where: str = "") -> None:
    """Refuse the sampling fields our first token cannot honour (``fields``: an OpenAI body, or
    /generate's ``sampling_params``; ``where``: the latter's prefix for the field name)."""
    first_draw.check(fields, _WHO, where, first_draw.SGLANG_NOT_APPLIED)


@dataclass(frozen=True)
class Generate:
    """A POST /generate body (SGLang's native API), as far as the prefill reads it."""

    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    max_new_tokens: int | None
    stream: bool
    num_logprobs: int | None  # return_logprob: the first token's (sampled + top_logprobs_num)
    rid: str | None
    skip_special_tokens: bool = True  # (SGLang's default)


def parse_generate(raw: dict, eos_ids: tuple[int, ...], vocab: int) -> Generate:
    """``eos_ids``: the model's end tokens (banned from the first token with ``min_new_tokens``);
    ``vocab``: the vocabulary's size (token ids are checked against it)."""
    if not isinstance(raw, dict):
        raise InvalidRequest("the request body must be a JSON object")
    text, ids = raw.get("text"), raw.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidRequest("send exactly one of 'text' (a string) and 'input_ids' (a list of token ids)",
                             field="text")
    if text is not None and not isinstance(text, str) or isinstance(text, str) and not text:
        raise InvalidRequest("'text' must be a non-empty string (one prompt per request)", field="text")
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise InvalidRequest("'input_ids' must be a non-empty list of token ids (one prompt per request)",
                             field="input_ids")
    s = raw.get("sampling_params") or {}
    if not isinstance(s, dict):
        raise InvalidRequest("'sampling_params' must be an object", field="sampling_params")
    check_sampling(s, "sampling_params.")

    def number(key: str, default: float, kinds=(int, float)) -> float:
        v = s.get(key, default)
        v = default if v is None else v
        if not isinstance(v, kinds) or isinstance(v, bool):
            raise InvalidRequest(f"'sampling_params.{key}' must be a number", field=f"sampling_params.{key}")
        return v

    top_k = int(number("top_k", -1, (int,)))
    n, max_new = number("n", 1, (int,)), s.get("max_new_tokens")
    if n != 1:
        raise InvalidRequest("'sampling_params.n' must be 1 (one answer per request)", field="sampling_params.n")
    if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1):
        raise InvalidRequest("'sampling_params.max_new_tokens' must be a positive integer",
                             field="sampling_params.max_new_tokens")
    seed = s.get("sampling_seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InvalidRequest("'sampling_params.sampling_seed' must be an integer", field="sampling_params.sampling_seed")
    min_new = s.get("min_new_tokens")
    if min_new is not None and (not isinstance(min_new, int) or isinstance(min_new, bool) or min_new < 0
                                or max_new is not None and min_new > max_new):
        raise InvalidRequest("'sampling_params.min_new_tokens' must be an integer from 0 to max_new_tokens",
                             field="sampling_params.min_new_tokens")
    min_p = number("min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise InvalidRequest("'sampling_params.min_p' must be in [0, 1]", field="sampling_params.min_p")
    rep = number("repetition_penalty", 1.0)  # (SGLang's counts output tokens only: not our first token's)
    if not 0.0 < rep <= 2.0:
        raise InvalidRequest("'sampling_params.repetition_penalty' must be in (0, 2] (1.0 = no penalty)",
                             field="sampling_params.repetition_penalty")
    stop_ids = first_draw.token_ids(s.get("stop_token_ids"), "sampling_params.stop_token_ids", vocab)
    sampling = SamplingParams(temperature=float(number("temperature", 1.0)), top_p=float(number("top_p", 1.0)),
                              top_k=-1 if top_k <= 0 or top_k >= TOP_K_ALL else top_k, seed=seed, min_p=float(min_p),
                              logit_bias=first_draw.logit_bias(s.get("logit_bias"), vocab, "sampling_params.", False),
                              banned_token_ids=first_draw.stop_bans(min_new, stop_ids, eos_ids), sampler="sglang")
    first_draw.check_left(sampling.banned_token_ids, None, vocab, "sampling_params.")
    num_logprobs = None
    if raw.get("return_logprob") is True:
        k = raw.get("top_logprobs_num") or 0
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise InvalidRequest("'top_logprobs_num' must be an integer >= 0", field="top_logprobs_num")
        num_logprobs = k
    skip = s.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise InvalidRequest("'sampling_params.skip_special_tokens' must be a boolean",
                             field="sampling_params.skip_special_tokens")
    stream, rid = raw.get("stream", False), raw.get("rid")
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", field="stream")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequest("'rid' must be a string (one prompt per request)", field="rid")
    return Generate(text, ids, sampling, max_new, stream, num_logprobs, rid, skip)


def generate_answer(g: Generate, request_id: str, token: int, token_text: str, eos: bool, num_prompt: int,
                    num_cached: int, logprobs: tuple[tuple[int, float], ...] | None) -> dict:
    """The prefill's own /generate answer: its one token, in SGLang's shape (the router answers the
    client with the decode's). ``token_text``: ``first_text``'s."""
    meta = {"id": g.rid or request_id, "prompt_tokens": num_prompt, "completion_tokens": 1,
            "cached_tokens": num_cached,
            "finish_reason": {"type": "stop", "matched": token} if eos else {"type": "length", "length": 1}}
    if logprobs is not None:
        meta["output_token_logprobs"] = [[logprobs[0][1], logprobs[0][0], None]]
        meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in logprobs[1:]]]
    return {"text": token_text, "output_ids": [token], "meta_info": meta}


def first_text(tokenizer, g: Generate, prompt_ids: list[int], token: int) -> str:
    """The text the first token adds after the prompt, as SGLang's incremental detokenizer shows it
    (it decodes from a few prompt tokens back, so a SentencePiece word keeps its leading space;
    special tokens skipped unless asked for); "" for part of a character."""
    return tokenizer.continuation_text(prompt_ids, token, g.skip_special_tokens) or ""


def server_info(info, page_size: int | None, bootstrap_port: int) -> dict:
    """GET /server_info as an SGLang prefill answers it, with the fields sglang-router reads (its
    worker labels) and those an SGLang decode checks (``ModelInfo`` ``info``: ours)."""
    from importlib import metadata

    try:
        version = metadata.version("prefill-server")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"model_path": info.path, "served_model_name": info.served_name, "tokenizer_path": info.path,
            "tp_size": 1, "dp_size": 1, "pp_size": 1, "load_balance_method": "round_robin",
            "disaggregation_mode": "prefill", "disaggregation_transfer_backend": "nixl",
            "disaggregation_bootstrap_port": bootstrap_port, "page_size": page_size, "dtype": info.dtype,
            "kv_cache_dtype": "auto", "context_length": info.max_model_len, "max_req_input_len": info.max_model_len - 1,
            "status": "ready", "version": f"prefill-server {version}", "frontend": "prefill-server"}


def model_info(info) -> dict:
    """GET /model_info as an SGLang server answers it (the model's architecture from its config.json)."""
    import pathlib

    try:
        cfg = json.loads((pathlib.Path(info.path) / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    return {"model_path": info.path, "served_model_name": info.served_name, "tokenizer_path": info.path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
            "disaggregation_mode": "prefill", "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": cfg.get("model_type"), "architectures": cfg.get("architectures")}

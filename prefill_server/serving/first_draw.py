"""How a request's fields reach the first token drawn here (SGLang decodes; a server without a
decode): the engine's sampler applies temperature, top_p, top_k, seed, min_p, the repetition
penalty, logit_bias, allowed_token_ids, bad_words and min_tokens (the stop tokens banned); ``check`` refuses a
request setting a field it does not apply, naming it, rather than answering from a token drawn
without it. Token ids are checked against the vocabulary as vLLM checks them (400, not an index
error later)."""
from __future__ import annotations

import json
import math

from prefill_server.engine.worker import SamplingParams
from prefill_server.errors import InvalidRequest

# field (vLLM's and SGLang's names) -> the value that means "off" (null, {} and [] do too). Presence and
# frequency penalties count output tokens only, so they leave the first token as it is.
_NOT_APPLIED = {"structured_outputs": None, "json_schema": None, "regex": None,
                "ebnf": None, "structural_tag": None, "custom_logit_processor": None, "use_beam_search": False}
# SGLang has neither: its decode would draw every later token without them
SGLANG_NOT_APPLIED = {"allowed_token_ids": None, "bad_words": None}
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default


def openai_sampling(b, raw: dict, eos_ids: tuple[int, ...], vocab: int, sglang: bool = False,
                    tokenizer=None) -> SamplingParams:
    """How the first token is drawn for a parsed OpenAI body ``b`` (``raw``: as sent): by vLLM's rules,
    or (``sglang``) by an SGLang decode's, whose repetition penalty counts output tokens only
    (``tokenizer``: for ``bad_words``)."""
    stop_ids = token_ids(b.stop_token_ids, "stop_token_ids", vocab)
    allowed = None if b.allowed_token_ids is None else token_ids(b.allowed_token_ids, "allowed_token_ids", vocab)
    if allowed == ():  # (vLLM refuses it when it checks the ids against the model)
        raise InvalidRequest("'allowed_token_ids' is empty: list at least one token id, or leave it out",
                             field="allowed_token_ids")
    bans = stop_bans(b.min_tokens, stop_ids, eos_ids)
    if b.bad_words and tokenizer is not None:
        bans = tuple(sorted(set(bans).union(bad_word_bans(b.bad_words, tokenizer))))
    check_left(bans, allowed, vocab)
    return SamplingParams(temperature=b.temperature if b.temperature is not None else 1.0,
                          top_p=b.top_p if b.top_p is not None else 1.0,
                          top_k=b.top_k if b.top_k else -1, seed=b.seed, min_p=b.min_p or 0.0,
                          repetition_penalty=1.0 if sglang or b.repetition_penalty is None else b.repetition_penalty,
                          logit_bias=logit_bias(b.logit_bias, vocab, "", clamp=not sglang),
                          allowed_token_ids=allowed, banned_token_ids=bans, sampler="sglang" if sglang else "vllm")


def token_ids(value, field: str, vocab: int) -> tuple[int, ...]:
    """A list of token ids of the vocabulary (``field``: its name, for the message); null is none."""
    if value is None:
        return ()
    if not (isinstance(value, list) and all(type(i) is int for i in value)):
        raise InvalidRequest(f"'{field}' must be a list of token ids (integers), not {json.dumps(value)[:40]}",
                             field=field)
    bad = [i for i in value if not 0 <= i < vocab]
    if bad:
        raise InvalidRequest(f"'{field}' holds token ids outside the vocabulary ({bad[:5]}): ids are 0 to "
                             f"{vocab - 1}", field=field)
    return tuple(value)


def logit_bias(value, vocab: int, where: str, clamp: bool) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` ({"token id": bias}) as (id, bias) pairs: keys as integers (the last of equal
    ones wins), biases clamped to [-100, 100] where vLLM clamps them (``clamp``; SGLang adds them as
    sent)."""
    if value is None or value == {}:
        return ()
    field = f"{where}logit_bias"
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{field}' must be an object mapping token ids to biases", field=field)
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            t = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"'{field}' key {json.dumps(key)[:30]} is not a token id (an integer)",
                                 field=field) from None
        if not 0 <= t < vocab:
            raise InvalidRequest(f"'{field}' key {t} is outside the vocabulary: ids are 0 to {vocab - 1}", field=field)
        # (vLLM clamps an infinite bias too; SGLang would add it)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias) or \
                (not clamp and math.isinf(bias)):
            raise InvalidRequest(f"'{field}' bias for {t} must be a finite number", field=field)
        out[t] = min(100.0, max(-100.0, float(bias))) if clamp else float(bias)
    return tuple(out.items())


def bad_word_bans(words: list[str], tokenizer) -> tuple[int, ...]:
    """The token ids ``bad_words`` keep from the first token, as vLLM builds and applies them: each
    word tokenized without and with a leading space (the second kept only where it is another word of
    as many tokens); a word of one token is never drawn, a longer one only after its first tokens
    were, which no first token follows."""
    variants: list[list[int]] = []
    for word in words:
        for space in ("", " "):
            ids = tokenizer.encode(space + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not space:
                    raise InvalidRequest("bad_words entries must tokenize to at least one token: drop empty or "
                                         "blank words", field="bad_words")
                continue
            if not space or (ids[0] != variants[-1][0] and len(ids) == len(variants[-1])):
                variants.append(ids)
    if len(variants) > MAX_BAD_WORDS:
        raise InvalidRequest(f"too many bad words after tokenization: {len(variants)}, at most {MAX_BAD_WORDS} (vLLM's "
                             "default VLLM_MAX_NUM_BAD_WORDS)", field="bad_words")
    return tuple(sorted({ids[0] for ids in variants if len(ids) == 1}))


def stop_bans(min_tokens, stop_token_ids: tuple[int, ...], eos_ids) -> tuple[int, ...]:
    """The token ids the first token may not be: with ``min_tokens`` >= 1, the stop tokens (the model's
    end tokens and ``stop_token_ids``, checked), as vLLM's min-tokens logits processor and SGLang's
    min-new-tokens penalizer mask them until that many tokens are out (``ignore_eos`` or not)."""
    return tuple(sorted(set(eos_ids).union(stop_token_ids))) if min_tokens else ()


def check_left(bans: tuple[int, ...], allowed: tuple[int, ...] | None, vocab: int, where: str = "") -> None:
    """Refuse a request whose first token could be none (every allowed token a banned stop token)."""
    if not bans:
        return
    left = bool(set(allowed) - set(bans)) if allowed is not None else len(set(bans)) < vocab
    if not left:
        field = f"{where}allowed_token_ids" if allowed is not None else f"{where}stop_token_ids"
        raise InvalidRequest("no token is left to draw: every allowed token is banned (a stop token while min_tokens "
                             "is not reached, or a bad word); allow more tokens, lower min_tokens or drop bad words",
                             field=field)


def check(fields: dict, who: str, where: str = "", also: dict | None = None) -> None:
    """Refuse the fields of ``fields`` (an OpenAI body, or /generate's ``sampling_params`` with
    ``where`` its prefix) that the first token drawn here would ignore; ``who``: what draws it, for
    the message; ``also``: more such fields (name -> the value meaning "off")."""
    for key, off in (_NOT_APPLIED | (also or {})).items():
        v = fields.get(key)
        if v is not None and v != off and v != {} and v != []:
            raise InvalidRequest(f"'{where}{key}' changes how the first token is drawn; {who} draws it without it: "
                                 f"drop it (or leave it at {json.dumps(off)})", field=f"{where}{key}")
    fmt = fields.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise InvalidRequest(f"'{where}response_format' {json.dumps(fmt.get('type'))[:40]} constrains the first "
                             f"token; {who} draws it unconstrained: drop it", field=f"{where}response_format")
    choice = fields.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        raise InvalidRequest(f"'{where}tool_choice' {json.dumps(choice)[:60]} constrains the first token to a tool "
                             f"call; {who} draws it unconstrained: use \"auto\" or \"none\"",
                             field=f"{where}tool_choice")

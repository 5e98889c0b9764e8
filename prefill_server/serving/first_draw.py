"""How the request's fields reach the first token drawn here (SGLang decodes; a server without a
decode). The engine's sampler applies temperature, top_p, top_k, seed and ``min_tokens`` (the stop
tokens banned, ``stop_bans``); a request setting a field it does not apply is refused, naming it,
rather than answered from a token drawn without it."""
from __future__ import annotations

import json

from prefill_server.errors import InvalidRequest

# field (vLLM's and SGLang's names) -> the value that means "off" (null, {} and [] do too). Presence and
# frequency penalties count output tokens only, so they leave the first token as it is; the
# repetition penalty counts the prompt's.
_NOT_APPLIED = {"min_p": 0.0, "repetition_penalty": 1.0, "logit_bias": None, "allowed_token_ids": None,
                "bad_words": None, "logits_processors": None, "structured_outputs": None, "json_schema": None,
                "regex": None, "ebnf": None, "structural_tag": None, "custom_logit_processor": None,
                "use_beam_search": False}


def stop_bans(min_tokens, stop_token_ids, eos_ids, where: str = "") -> tuple[int, ...]:
    """The token ids the first token may not be: with ``min_tokens`` >= 1, the stop tokens (the model's
    end tokens and ``stop_token_ids``), as vLLM's min-tokens logits processor and SGLang's
    min-new-tokens penalizer mask them until that many tokens are out (``ignore_eos`` or not)."""
    if not min_tokens:
        return ()
    ids = [] if stop_token_ids is None else stop_token_ids
    if not (isinstance(ids, list) and all(type(i) is int for i in ids)):
        raise InvalidRequest(f"'{where}stop_token_ids' must be a list of token ids (integers), not "
                             f"{json.dumps(ids)[:40]}", field=f"{where}stop_token_ids")
    return tuple(sorted(set(eos_ids).union(ids)))


def check(fields: dict, who: str, where: str = "") -> None:
    """Refuse the fields of ``fields`` (an OpenAI body, or /generate's ``sampling_params`` with
    ``where`` its prefix) that the first token drawn here would ignore; ``who``: what draws it, for
    the message."""
    for key, off in _NOT_APPLIED.items():
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

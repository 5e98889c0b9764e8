"""Tokenizer from a Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json``), using the
``tokenizers`` library directly and rendering chat templates with a sandboxed jinja2, so that ids
and prompts match ``transformers.AutoTokenizer`` without importing transformers.

BOS/EOS: as in transformers 5, the post-processor in tokenizer.json alone decides what
``add_special_tokens=True`` adds (tokenizer_config's add_bos_token is ignored when tokenizer.json
exists)."""
from __future__ import annotations

import datetime
import functools
import json
import pathlib
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from prefill_server.errors import InvalidRequest

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_str(v: Any) -> str | None:
    """tokenizer_config values are a string or an AddedToken dict {"content": ...}."""
    if isinstance(v, dict):
        return v.get("content")
    return v


class Tokenizer:
    def __init__(self, path: str | pathlib.Path):
        path = pathlib.Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.special_tokens = {k: _token_str(cfg.get(k)) for k in _SPECIAL_KEYS if _token_str(cfg.get(k))}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.clean_up_tokenization_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        self.chat_template = self._load_chat_template(path, cfg)
        self._compiled = None
        self._names_developer = False  # (set with _compiled: does the template know the developer role?)

    @staticmethod
    def _load_chat_template(path: pathlib.Path, cfg: dict) -> str | None:
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for: its vocabulary string's length (one
        character per byte in byte-level BPE vocabularies, as long as the text in the others)."""
        return max(1, max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest(f"prompt must be a string, got {type(text).__name__}", field="prompt")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    @functools.cached_property
    def _space_marker(self) -> str | None:
        """(found on first use, not at start-up: serializing a large vocabulary to JSON is not free)"""
        return _leading_space_marker(json.loads(self._tok.to_str()))

    def token_string(self, token_id: int) -> str:
        """One token's text as vLLM shows it in logprobs: decode([id]), with the leading spaces a
        SentencePiece (Metaspace) decode strips from a piece put back."""
        text = self.decode([token_id])
        if self._space_marker is None:
            return text
        raw = self.id_to_token(token_id) or ""
        markers = len(raw) - len(raw.lstrip(self._space_marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def continuation_text(self, context_ids: list[int], token_id: int, skip_special_tokens: bool = True) -> str | None:
        """The text ``token_id`` adds after ``context_ids`` (as an incremental detokenizer shows it),
        or None where that is not a whole piece of text (an incomplete UTF-8 character)."""
        ctx = list(context_ids[-6:])
        before = self.decode(ctx, skip_special_tokens)
        after = self.decode(ctx + [token_id], skip_special_tokens)
        if not after.startswith(before) or "\ufffd" in after[len(before):]:
            return None
        return after[len(before):]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """Render ``messages`` ([{"role": str, "content": str}, ...]) to the prompt string.
        ``continue_final_message``: the text ends inside the final message, for the model to go on
        with it (as transformers renders it: the template's own end of that message is cut off)."""
        if self.chat_template is None:
            raise InvalidRequest("this model's tokenizer has no chat template; send a plain prompt instead",
                                 field="messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true: set "
                                 "add_generation_prompt to false to continue the final message",
                                 field="continue_final_message")
        messages = validate_messages(messages)
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
            self._names_developer = '"developer"' in self.chat_template or "'developer'" in self.chat_template
        if not self._names_developer:
            messages = developer_as_system(messages)
        context = {**self.special_tokens, **kwargs}
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        if continue_final_message:
            return self._render_continued(messages, context)
        return self._render(messages, add_generation_prompt, context)

    def _render_continued(self, messages: list[dict[str, Any]], context: dict) -> str:
        """The chat rendered up to the end of the final message's content: a marker appended to that
        content locates it in the rendered text, and everything from the marker on is dropped (with
        the whitespace before it where the template trimmed the marker's own trailing space)."""
        if "content" not in self.chat_template:
            raise InvalidRequest("continue_final_message: this model's chat template has no message content "
                                 "to continue", field="continue_final_message")
        final = messages[-1]["content"]
        marked = messages[:-1] + [{**messages[-1], "content": final + _CONTINUE_MARK}]
        text = self._render(marked, False, context)
        mark = _CONTINUE_MARK.strip()
        if final.strip() not in text or mark not in text:
            raise InvalidRequest("continue_final_message: the chat template drops part of the final message, "
                                 "so it cannot be continued; send it without continue_final_message",
                                 field="continue_final_message")
        at = text.rindex(mark)
        return text[:at] if text[at:at + len(_CONTINUE_MARK)] == _CONTINUE_MARK else text[:at].rstrip()

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, context: dict) -> str:
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **context)
        except jinja2.TemplateError as e:  # raise_exception() in the template: the caller's input
            raise InvalidRequest(f"chat template rejected the messages: {e}", field="messages") from None
        except (TypeError, ValueError, LookupError, AttributeError) as e:  # a field of an unexpected type
            raise InvalidRequest(f"the chat template could not render these messages ({type(e).__name__}: {e}); "
                                 "check the types of the messages' extra fields and of tools", field="messages") from None

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Ids of the rendered chat; like HF, the template supplies any BOS (no special tokens added)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


# transformers' marker (5.x), so that a template that treats it specially cuts where the decode's does
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """A non-empty list of {"role": str, "content": str} dicts; keys with value None are dropped."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", field="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content', "
                                 f"got {type(m).__name__}", field="messages")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m or m[key] is None else type(m[key]).__name__
                raise InvalidRequest(f"messages[{i}].{key} must be a string ({got})", field="messages")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's ``developer`` messages for a chat template that does not name that role, as vLLM 0.32
    renders them: each becomes a ``system`` message (its ``tools`` dropped), then, if a system message
    is not first or there are several, their non-empty contents are merged into one system message at
    the front (joined by a blank line; the others' order kept)."""
    if not any(m["role"] == "developer" for m in messages):
        return messages
    messages = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer"
                else m for m in messages]
    system, rest, merge = [], [], False
    for i, m in enumerate(messages):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(system)
        if m.get("content"):
            system.append(m["content"])
    return [{"role": "system", "content": "\n\n".join(system)}, *rest] if merge else messages


def _leading_space_marker(tokenizer_json: dict) -> str | None:
    """The Metaspace replacement character (SentencePiece's '▁') if the pre-tokenizer has one."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    for p in [pre, *(pre.get("pretokenizers") or [])]:
        if p.get("type") == "Metaspace":
            return p.get("replacement", "▁")
    return None


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _compile(template: str) -> jinja2.Template:
    """Same environment as transformers' chat templates: sandboxed, trim/lstrip blocks, loopcontrols,
    a tojson that does not escape HTML, raise_exception and strftime_now."""

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)

"""Tokenizer and chat-template parity with the decodes, checked at start-up (``--tokenizer-parity``).

Our KV is right only for the very token ids the decode continues from. This server tokenizes with
its own code (``models/tokenizer.py``: tokenizer.json + the chat template); a decode tokenizes with
whatever its framework picks (vLLM 0.32 with transformers 5 takes the tokenizer class of the
model's ``model_type``, which may ignore tokenizer.json's pipeline), or with its own ``--tokenizer``
or ``--chat-template``. So before serving, a fixed set of texts (whitespace runs, newlines and
indentation, unicode, digits, special tokens, long words, code) and chats (system, multi-turn,
tools where the template renders them) is tokenized here and by each decode's ``POST /tokenize``.
Any difference is reported with the first differing case and token, then the policy decides:

    refuse  (default) do not start: name the difference and the fixes. A silent difference means
            every answer differs from the decode's own from the first token, with no error anywhere,
            and only the user can choose which tokenizer is right
    decode  tokenize every text and chat through a decode's /tokenize (``decode_tokenizer.py``):
            exact whatever the decode runs, for a round trip per request
    warn    log the difference and serve with our tokens

Requests sent as token ids are not tokenized; they are checked against the decode's vocabulary
(``ParityOutcome.vocab_size``) as well as the model's.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prefill_server.config import TOKENIZER_PARITY_POLICIES as POLICIES
from prefill_server.errors import DecodeUnavailable, InvalidRequest
from prefill_server.serving.decode_tokenizer import DecodeTokenizer

log = logging.getLogger(__name__)

TEXTS: tuple[str, ...] = (
    "Hello, world!",
    "  two leading spaces, three trailing   ",
    "runs of spaces:  2   3    4     5          10",
    "tabs\tand\t\ttabs\t",
    "line one\nline two\n\n\nafter three newlines\r\nCRLF\rCR",
    "def f(n):\n    ...",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint(fib(10))\n",
    "    \n\t  \n   ",
    "1234567890 3.14159 1,000,000 -42 2026-12-02 0x1F 1e-9 ①②③ ٣٤٥",
    "naïve café, Zürich, São Paulo, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어, עברית, العربية",
    "emoji 🙂👍🏽🚀, a ZWJ sequence 👩‍💻, combining e\u0301 and NFC é, NBSP\u00a0here, zero-width\u200bspace",
    "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism "
    "supercalifragilisticexpialidocious " + "a" * 120,
    '{"json": [1, 2.5, {"k": null, "s": "x\\ny"}]} <div class="x">&amp;</div> https://example.com/a?b=1&c=2#d',
    "MixedCASE camelCase snake_case SCREAMING_CASE kebab-case don't it's we'll I'M",
)
_PLAIN_TOO = (0, 5)  # these texts are also checked without special tokens (gRPC's add_special_tokens)
_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHATS: tuple[tuple[str, list[dict[str, Any]]], ...] = (
    ("system + user", [{"role": "system", "content": "You are terse."},
                       {"role": "user", "content": "What is 2 + 2?"}]),
    ("user only (the template's default system)", [{"role": "user", "content": "Héllo 🙂 — ¿qué tal?\n"}]),
    ("multi-turn", [{"role": "user", "content": "Write a function."},
                    {"role": "assistant", "content": "def f(n):\n    return n * 2\n"},
                    {"role": "user", "content": "  Now  in one line,\tplease.\n\n"}]),
)
_TOOL_CHAT = ("tools", [{"role": "user", "content": "The weather in Paris?"}])


@dataclass(frozen=True)
class Case:
    name: str
    text: str | None = None
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def cases(tokenizer) -> list[Case]:
    """The probe's texts and chats for ``tokenizer`` (its own special tokens; tools only where its
    chat template renders them)."""
    out = [Case(f"text {_show(t)}", t) for t in TEXTS]
    out += [Case(f"text {_show(TEXTS[i])} without special tokens", TEXTS[i], False) for i in _PLAIN_TOO]
    specials = sorted({v for v in getattr(tokenizer, "special_tokens", {}).values() if v})
    if specials:
        text = "".join(f"{s}\nspecial {s}{s} token " for s in specials)
        out += [Case(f"text {_show(text)}", text), Case(f"text {_show(text)} without special tokens", text, False)]
    template = getattr(tokenizer, "chat_template", None) or ""
    out += [Case(f"chat '{name}'", messages=m) for name, m in CHATS]
    if "tools" in template:
        out.append(Case(f"chat '{_TOOL_CHAT[0]}'", messages=_TOOL_CHAT[1], tools=_TOOLS))
    return out


def _show(text: str, n: int = 48) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def local_chat_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None,
                   check_text: Callable[[str], None] | None = None) -> list[int]:
    """A chat's ids as this server makes them: the template renders the text (and its special
    tokens), which is tokenized without adding any unless ``template_kwargs`` says
    ``add_special_tokens`` (``chat_render.template_kwargs``: the rest go to the template, with
    ``add_generation_prompt`` true unless given). ``check_text``: may refuse the rendered text."""
    kwargs = dict(template_kwargs or {})
    add_special = kwargs.pop("add_special_tokens", False)
    kwargs.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(messages, **kwargs)
    if check_text is not None:
        check_text(text)
    return tokenizer.encode(text, add_special_tokens=add_special)


Result = tuple[int, ...] | str  # the ids, or why the input was refused


def _local(tokenizer, c: Case) -> Result:
    try:
        if c.text is not None:
            return tuple(tokenizer.encode(c.text, add_special_tokens=c.add_special_tokens))
        return tuple(local_chat_ids(tokenizer, c.messages, {"tools": c.tools} if c.tools else None))
    except InvalidRequest as e:
        return f"refused ({e.message})"


def _remote(decode: DecodeTokenizer, c: Case) -> Result:
    try:
        if c.text is not None:
            return tuple(decode.encode(c.text, c.add_special_tokens))
        return tuple(decode.encode_chat(c.messages, {"tools": c.tools} if c.tools else None))
    except InvalidRequest as e:
        return f"refused ({e.message})"


@dataclass(frozen=True)
class Difference:
    """The first case two tokenizers disagree on, and where."""

    case: str
    ours: Result
    theirs: Result
    position: int | None  # the first differing token (None: one side refused the input)

    def describe(self, tokenizer=None, here: str = "here", there: str = "at the decode") -> str:
        if self.position is None:
            def what(r: Result) -> str:
                return r if isinstance(r, str) else f"{len(r)} tokens"
            return f"{self.case}: {what(self.ours)} {here}, {what(self.theirs)} {there}"
        i = self.position
        return (f"{self.case} is {len(self.ours)} tokens {here} and {len(self.theirs)} {there}; the first difference "
                f"is at token {i}: {here} {_token(self.ours, i, tokenizer)}, {there} {_token(self.theirs, i, tokenizer)}")


def _token(ids: Result, i: int, tokenizer) -> str:
    if i >= len(ids):
        return "(the end)"
    piece = tokenizer.id_to_token(ids[i]) if tokenizer is not None else None
    return f"{ids[i]}" + (f" ({piece!r})" if piece is not None else "")


def first_difference(case: str, ours: Result, theirs: Result) -> Difference | None:
    if ours == theirs:
        return None
    if isinstance(ours, str) or isinstance(theirs, str):
        if isinstance(ours, str) and isinstance(theirs, str):
            return None  # both refuse the input (their words differ)
        return Difference(case, ours, theirs, None)
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return Difference(case, ours, theirs, i)


@dataclass(frozen=True)
class ParityReport:
    url: str
    cases: int = 0
    seconds: float = 0.0
    difference: Difference | None = None
    error: str | None = None  # the probe could not ask the decode
    vocab_size: int | None = None  # the decode model's, when it says
    results: tuple[Result, ...] = field(default=(), repr=False)  # the decode's, to compare decodes

    @property
    def same(self) -> bool:
        return self.error is None and self.difference is None


PROBE_CONCURRENCY = 8  # requests in flight to one decode: a busy decode's API server answers each late


def probe(tokenizer, decode: DecodeTokenizer) -> ParityReport:
    """Tokenize every case here and at ``decode``; the first difference, if any."""
    t0 = time.perf_counter()
    todo = cases(tokenizer)
    try:
        with ThreadPoolExecutor(max_workers=PROBE_CONCURRENCY) as ex:
            vocab = ex.submit(decode.vocab_size)
            theirs = list(ex.map(lambda c: _remote(decode, c), todo))
            vocab_size = vocab.result()
    except DecodeUnavailable as e:
        return ParityReport(decode.url, 0, time.perf_counter() - t0, error=e.message)
    finally:
        decode.close_blocking()
    diff = next((d for c, r in zip(todo, theirs) if (d := first_difference(c.name, _local(tokenizer, c), r))), None)
    return ParityReport(decode.url, len(todo), time.perf_counter() - t0, diff, vocab_size=vocab_size,
                        results=tuple(theirs))


@dataclass(frozen=True)
class ParityOutcome:
    policy: str
    reports: tuple[ParityReport, ...] = ()
    through_decode: tuple[DecodeTokenizer, ...] = ()  # non-empty: tokenize every request there
    vocab_size: int | None = None  # the smallest decode vocabulary that was said


class TokenizerMismatch(ValueError):
    """The policy refuses to start: the message names the difference and the fixes."""


def check_fleet(tokenizer, decodes: list[DecodeTokenizer], policy: str, model_path: str = "") -> ParityOutcome:
    """Probe each decode (all at once) and apply ``policy``: raises ``TokenizerMismatch`` to refuse."""
    assert policy in POLICIES, policy
    with ThreadPoolExecutor(max_workers=min(8, len(decodes)) or 1) as ex:
        reports = tuple(ex.map(lambda d: probe(tokenizer, d), decodes))
    unchecked = [f"tokenizer parity could not be checked with the decode at {r.url}: {r.error}{_UNCHECKED}"
                 for r in reports if r.error]
    src = f" (from {model_path})" if model_path else ""
    differ = [f"the decode at {r.url} tokenizes differently from this server{src}: "
              f"{r.difference.describe(tokenizer)}{_FIXES}" for r in reports if r.difference]
    among = _among_decodes(reports, tokenizer)
    for r in reports:
        if r.same:
            log.info("tokenizer parity with the decode at %s: %d texts and chats tokenized alike (%.0f ms)",
                     r.url, r.cases, r.seconds * 1e3)
    # decode: tokenizing through a decode needs it to answer, and all decodes to agree
    fatal = {"refuse": unchecked + differ + among, "decode": unchecked + among, "warn": []}[policy]
    if fatal:
        raise TokenizerMismatch("; ".join(fatal))
    for p in unchecked + differ + among:
        log.warning("%s [--tokenizer-parity %s: serving anyway]", p, policy)
    through = tuple(decodes) if policy == "decode" else ()
    if through:
        log.info("--tokenizer-parity decode: every text prompt and chat is tokenized by the POST /tokenize of %s",
                 ", ".join(d.url for d in decodes))
    vocabs = [r.vocab_size for r in reports if r.vocab_size]
    return ParityOutcome(policy, reports, through, min(vocabs) if vocabs else None)


def recheck(tokenizer, outcome: ParityOutcome, decode: DecodeTokenizer) -> str | None:
    """A decode that was down and answers again may be another server (restarted with its own
    ``--tokenizer`` or ``--chat-template``, a new model folder): probe it again before it takes
    requests. Returns why it must stay out of rotation, or None to take it back. The policy is the
    start-up one: ``refuse`` wants our tokens, ``decode`` the tokens of the other decodes (a request
    tokenized at one may go to another), ``warn`` only logs."""
    r = probe(tokenizer, decode)
    if r.error:
        problem = f"tokenizer parity could not be checked with the decode at {r.url}: {r.error}"
    elif outcome.policy == "decode":
        # alone, a decode that tokenizes every request itself cannot disagree with itself
        ref = next((x for x in outcome.reports if x.error is None and x.url != r.url), None)
        problem = next((f"the decode at {r.url} came back tokenizing differently from the decode at {ref.url} "
                        f"(--tokenizer-parity decode tokenizes every request at either): "
                        + d.describe(tokenizer, f"at {ref.url}", f"at {r.url}")
                        for c, a, b in zip(cases(tokenizer), ref.results, r.results)
                        if (d := first_difference(c.name, a, b))), None) if ref is not None else None
    else:
        problem = None if r.difference is None else (
            f"the decode at {r.url} came back tokenizing differently from this server: "
            f"{r.difference.describe(tokenizer)}")
    if problem is None:
        log.info("tokenizer parity with the decode at %s, back up: %d texts and chats tokenized alike (%.0f ms)",
                 r.url, r.cases, r.seconds * 1e3)
        return None
    if outcome.policy == "warn":
        log.warning("%s [--tokenizer-parity warn: serving anyway]", problem)
        return None
    return (f"{problem}; it takes no requests until it tokenizes as before (restart it with the tokenizer "
            "and chat template it had), or restart this server to probe the fleet anew")


_FIXES = (". KV computed for this server's tokens makes the decode answer otherwise than it would alone, so "
          "the server does not start. Fix one: make the decode tokenize as this server does (the same "
          "tokenizer files and chat template, no --tokenizer or --chat-template of its own, and a config.json "
          "whose model_type does not make transformers pick another tokenizer class); or start this server "
          "with --tokenizer-parity decode (every prompt is tokenized by the decode's POST /tokenize); or with "
          "--tokenizer-parity warn to serve with this server's tokens anyway")
_UNCHECKED = (". Without the check the server does not start: make the decode's POST /tokenize answer (a vLLM "
              "OpenAI server serves it), or start with --tokenizer-parity warn to serve unchecked")


def _among_decodes(reports: tuple[ParityReport, ...], tokenizer) -> list[str]:
    """Decodes that tokenize differently from each other cannot share one tokenization."""
    ok = [r for r in reports if r.error is None]
    out = []
    for r in ok[1:]:
        for c, a, b in zip(cases(tokenizer), ok[0].results, r.results):
            if d := first_difference(c.name, a, b):
                out.append(f"the decodes at {ok[0].url} and {r.url} tokenize differently from each other: "
                           + d.describe(tokenizer, f"at {ok[0].url}", f"at {r.url}")
                           + ". Requests go to any of them: make them tokenize alike, or run one prefill "
                           "server per kind of decode")
                break
    return out

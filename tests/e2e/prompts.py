"""Deterministic test prompts from real English text present on every Debian machine.

Source: the license texts of ``/usr/share/common-licenses`` (package ``base-files``, always
installed; unlike ``/usr/share/doc/*/copyright`` the set does not depend on what else is installed).
Each prompt is a slice of one text chosen by a hash of the prompt's name, cut at word boundaries,
with hard line wraps joined. Lengths are approximate token counts (about 5 characters per token
for the SmolLM2 / Llama tokenizers on this text): from ~10 to ~3,000 tokens.

    from prompts import all_prompts   # tests/e2e is on sys.path under pytest
    for p in all_prompts(): p.name, p.kind, p.text or p.messages
"""
from __future__ import annotations

import functools
import hashlib
import pathlib
import re
from dataclasses import dataclass, field

LICENSE_DIR = pathlib.Path("/usr/share/common-licenses")
SOURCES = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic")
CHARS_PER_TOKEN = 4.9


@dataclass(frozen=True)
class Prompt:
    name: str
    approx_tokens: int
    text: str | None = None                       # plain completion prompt
    messages: tuple[dict, ...] | None = field(default=None)  # chat messages

    @property
    def kind(self) -> str:
        return "chat" if self.messages is not None else "plain"

    def chat(self) -> list[dict]:
        assert self.messages is not None
        return [dict(m) for m in self.messages]


@functools.lru_cache(maxsize=None)
def source_text(name: str) -> str:
    """The license text with paragraphs kept and line wraps joined."""
    path = LICENSE_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the e2e prompts need Debian's base-files "
                                "license texts (/usr/share/common-licenses)")
    raw = path.read_text(encoding="utf-8", errors="replace")
    paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", raw)]
    return "\n\n".join(p for p in paras if p)


def _slice(name: str, source: str, approx_tokens: int) -> str:
    """A deterministic excerpt of about approx_tokens tokens from source, at word boundaries."""
    text = source_text(source)
    n_chars = int(approx_tokens * CHARS_PER_TOKEN)
    if n_chars >= len(text):
        return text
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    start = seed % (len(text) - n_chars)
    while start > 0 and not text[start - 1].isspace():  # back up to a word start
        start -= 1
    end = start + n_chars
    while end < len(text) and not text[end].isspace():  # finish the word
        end += 1
    return text[start:end].strip()


_PLAIN = [  # (approx tokens, source)
    (10, "GPL-3"), (20, "Apache-2.0"), (40, "MPL-2.0"), (80, "GPL-3"), (150, "LGPL-2.1"),
    (300, "Apache-2.0"), (600, "GFDL-1.3"), (1000, "GPL-3"), (1500, "MPL-2.0"), (2000, "Apache-2.0"),
    (2500, "GPL-3"), (3000, "GPL-3"),
]
_CHAT = [  # (approx tokens of the excerpt, source, question)
    (10, "Artistic", "Rewrite this in plain words."),
    (30, "GPL-3", "What does this sentence mean?"),
    (60, "Apache-2.0", "Summarize this clause in one sentence."),
    (120, "MPL-2.0", "Who has to do what here?"),
    (250, "LGPL-2.1", "List the obligations this text creates."),
    (500, "GFDL-1.3", "Explain this to a new contributor."),
    (900, "GPL-3", "What are the three most important points?"),
    (1500, "Apache-2.0", "Does this allow commercial use? Answer briefly."),
    (2200, "GPL-3", "Summarize the text."),
    (2800, "MPL-2.0", "Give a title for this document."),
]
SYSTEM = "You are a careful assistant who explains software licenses briefly."


@functools.lru_cache(maxsize=1)
def all_prompts() -> tuple[Prompt, ...]:
    out: list[Prompt] = []
    for tokens, src in _PLAIN:
        name = f"plain-{src}-{tokens}"
        out.append(Prompt(name, tokens, text=_slice(name, src, tokens)))
    for i, (tokens, src, question) in enumerate(_CHAT):
        name = f"chat-{src}-{tokens}"
        excerpt = _slice(name, src, tokens)
        if i % 3 == 2:  # a multi-turn conversation now and then
            msgs = ({"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Here is a license excerpt:\n\n{excerpt}"},
                    {"role": "assistant", "content": "I have read it. What would you like to know?"},
                    {"role": "user", "content": question})
        else:
            msgs = ({"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"{question}\n\n{excerpt}"})
        out.append(Prompt(name, tokens, messages=msgs))
    return tuple(out)


def plain_prompts() -> list[Prompt]:
    return [p for p in all_prompts() if p.kind == "plain"]


def chat_prompts() -> list[Prompt]:
    return [p for p in all_prompts() if p.kind == "chat"]


def by_name(name: str) -> Prompt:
    for p in all_prompts():
        if p.name == name:
            return p
    raise KeyError(name)

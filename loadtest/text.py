"""Offline text for prompts, and prompt lengths in (approximate) tokens.

Sources: ``licenses`` (the license texts under /usr/share/common-licenses: real English prose found
on most Linux machines), ``words`` (a seedable generator over a fixed vocabulary: the same text on
every machine), or a path (a text file, or a folder whose files are read in name order).

Lengths: by default ~``chars_per_token`` characters per token (4.0: English under Llama-family
BPE tokenizers is 4-5 characters per token, so "N tokens" is an overestimate of about 0-20%). With
``tokenizer`` (a ``tokenizer.json`` file or a model folder holding one, read with the ``tokenizers``
package), passages are cut to exactly N tokens of that tokenizer (re-tokenizing a joined prompt may
differ by a few tokens at the seams).
"""
from __future__ import annotations

import pathlib
import random
import re

LICENSES_DIR = pathlib.Path("/usr/share/common-licenses")
DEFAULT_CHARS_PER_TOKEN = 4.0

# A fixed vocabulary: the ``words`` source draws sentences from it, so its text depends on the seed only.
_VOCAB = """the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there been one all we their has would when if so no will more can other
into some could them than then its our two what time only about may first new these over also after
any like very did made many before must through back years where much your way well down should
because each just those people how too little state good world still own see men work long here get
both between life being under never day same another know while last might us great old year off come
since against go came right used take three states himself few house use during without again place
around however home small found thought went say part once general high upon school every does got
united left number course war until always away something fact though water less public put think
almost hand enough far took head yet government system better set told nothing night end why called
didn't eyes find going look asked later knew point next program city business give group toward young
days let room president side social present given several order national possible rather second face
per among form important often things looking early white case john become large big need four within
felt along children saw best church ever least power development light thing seemed family interest
want members mind country area others done turned although open god service certain kind problem began
different door thus help sense means whole matter perhaps itself york times law human line above name
example action company hands local show whether five history gave today either act feet across taken
past quite anything seen having death experience body word half really week car field money words
already information tell together college shall themselves sure""".split()

_WS = re.compile(r"\s+")


class TextSource:
    """Passages of about N tokens, reproducible from a ``random.Random``."""

    def __init__(self, source: str = "licenses", *, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
                 tokenizer: str | None = None):
        if chars_per_token <= 0:
            raise ValueError("chars_per_token must be > 0")
        self.source, self.chars_per_token = source, chars_per_token
        self.corpus = None if source == "words" else _load_corpus(source)
        self.tokenizer = _load_tokenizer(tokenizer) if tokenizer else None

    # ---- lengths ----
    def count(self, text: str) -> int:
        """Tokens in ``text``: the tokenizer's count, or len / chars_per_token."""
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return max(1, round(len(text) / self.chars_per_token)) if text else 0

    # ---- text ----
    def passage(self, n_tokens: int, rng: random.Random) -> str:
        """About ``n_tokens`` tokens of text from a random place of the source."""
        if n_tokens <= 0:
            return ""
        if self.tokenizer is None:
            return self._chars(int(n_tokens * self.chars_per_token), rng)
        want = int(n_tokens * self.chars_per_token * 1.25) + 16
        while True:
            text = self._chars(want, rng)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) >= n_tokens:
                return self.tokenizer.decode(ids[:n_tokens])
            want = int(want * 1.5 * n_tokens / max(1, len(ids))) + 16

    def sentence(self, rng: random.Random, words: int = 12) -> str:
        """One sentence of the seedable vocabulary (whatever the source)."""
        w = [rng.choice(_VOCAB) for _ in range(max(1, words))]
        return " ".join(w).capitalize() + "."

    def _chars(self, n_chars: int, rng: random.Random) -> str:
        if self.corpus is None:
            return self._words(n_chars, rng)
        c = self.corpus
        start = rng.randrange(len(c))
        start = c.find(" ", start) + 1 if c.find(" ", start) >= 0 else 0  # begin at a word
        out, need = [], n_chars
        while need > 0:
            piece = c[start:start + need]
            out.append(piece)
            need -= len(piece)
            start = 0  # wrap around: a document longer than the corpus repeats it
        return "".join(out).strip() or c[:n_chars]

    def _words(self, n_chars: int, rng: random.Random) -> str:
        out, size = [], 0
        while size < n_chars:
            s = self.sentence(rng, rng.randint(6, 18))
            out.append(s)
            size += len(s) + 1
        return " ".join(out)[:n_chars].rstrip()


def _load_corpus(source: str) -> str:
    path = LICENSES_DIR if source == "licenses" else pathlib.Path(source)
    if path.is_dir():
        seen, parts = set(), []
        for f in sorted(path.rglob("*")):
            real = f.resolve()
            if f.is_file() and real not in seen:
                seen.add(real)
                parts.append(f.read_text(errors="replace"))
        text = " ".join(parts)
    elif path.is_file():
        text = path.read_text(errors="replace")
    else:
        raise FileNotFoundError(f"text source {source!r}: no such file or folder (use 'words' for generated text)")
    text = _WS.sub(" ", text).strip()
    if len(text) < 1000:
        raise ValueError(f"text source {source!r} holds only {len(text)} characters; give more text or 'words'")
    return text


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer  # only with --tokenizer

    p = pathlib.Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no tokenizer.json there")
    return Tokenizer.from_file(str(p))

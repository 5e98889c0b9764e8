"""A decode's own tokenizer and chat template, asked over its HTTP API: vLLM's ``POST /tokenize``.

    {"model", "prompt", "add_special_tokens"}                      -> {"tokens": [...], "count", ...}
    {"model", "messages", "add_generation_prompt", "tools", ...}   -> the rendered chat's tokens

(vLLM 0.32 ``entrypoints/serve/tokenize``: a text's ``add_special_tokens`` defaults to true, a chat's
to false, as in its completion and chat endpoints.) Used by the start-up parity probe
(``token_parity.py``, blocking calls) and, with ``--tokenizer-parity decode``, for every request
(``ThroughDecode``, async, timed in ``prefill_server:tokenize_remote_seconds``).
"""
from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx

from prefill_server.errors import DecodeNotReached, DecodeUnavailable, InvalidRequest

# the fields of a chat body that change how vLLM renders it, which /tokenize takes as they are
_CHAT_FIELDS = ("tools", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template")
_VOCAB_RE = re.compile(r"Vocabulary size: (\d+)")
_ERROR_CHARS = 500


def text_body(model: str, text: str, add_special_tokens: bool = True) -> dict:
    return {"model": model, "prompt": text, "add_special_tokens": add_special_tokens}


def chat_body(model: str, messages: list[dict], fields: dict | None = None) -> dict:
    return {"model": model, "messages": messages, "add_generation_prompt": True, **(fields or {})}


def chat_fields(request: dict) -> dict:
    """A chat body's rendering fields as /tokenize takes them, so that it renders what the decode's
    /v1/chat/completions will. vLLM 0.32's chat endpoint also hands ``documents``,
    ``reasoning_effort`` (and ``enable_thinking`` from it) to the template, which /tokenize takes
    only inside ``chat_template_kwargs``; unset values (None, "auto") are left out as vLLM does."""
    fields = {k: request[k] for k in _CHAT_FIELDS if request.get(k) is not None}
    kwargs = request.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return fields | {"chat_template_kwargs": kwargs}  # the decode refuses it, with its words
    kwargs = dict(kwargs or {})
    extra = {k: request[k] for k in ("documents", "reasoning_effort") if request.get(k) not in (None, "auto")}
    if request.get("reasoning_effort") is not None and "enable_thinking" not in kwargs:
        extra["enable_thinking"] = request["reasoning_effort"] != "none"
    kwargs |= extra
    return fields | ({"chat_template_kwargs": kwargs} if kwargs else {})


def _tokens(url: str, r: httpx.Response, what: str) -> list[int]:
    """The token ids of a /tokenize answer, or the error it stands for."""
    if r.status_code == 404:
        raise DecodeUnavailable(f"the decode at {url} has no POST /tokenize (404): it is not a vLLM OpenAI "
                                "server, so its tokenizer cannot be asked")
    if 400 <= r.status_code < 500:  # the decode refuses this input (its chat endpoint would too)
        raise InvalidRequest(f"the decode at {url} refused to tokenize the {what}: {_message(r)}",
                             field="messages" if what == "messages" else "prompt")
    if r.status_code != 200:
        raise DecodeUnavailable(f"the decode at {url} failed to tokenize ({r.status_code}: {_message(r)})")
    try:
        ids = r.json()["tokens"]
    except (ValueError, KeyError, TypeError):
        ids = None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise DecodeUnavailable(f"the decode at {url} answered /tokenize without a list of token ids")
    return ids


def _message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
        text = err.get("message") if isinstance(err, dict) else r.json().get("message") or r.text
    except (ValueError, AttributeError):
        text = r.text
    return str(text)[:_ERROR_CHARS]


def _unreachable(url: str, e: httpx.HTTPError) -> DecodeUnavailable:
    cls = DecodeNotReached if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) else DecodeUnavailable
    return cls(f"the decode at {url} could not be asked to tokenize ({type(e).__name__}: {e})")


class DecodeTokenizer:
    """One decode's tokenizer. Blocking calls for start-up, async ones for requests (the async
    client is made on first use in each event loop: a client is bound to the loop it first ran in).
    timeout_s: the probe's calls; request_timeout_s: a request's (a long prompt tokenizes long)."""

    def __init__(self, url: str, model: str, timeout_s: float = 10.0, request_timeout_s: float = 600.0):
        self.url, self.model, self.timeout_s = url.rstrip("/"), model, timeout_s
        self.request_timeout_s = request_timeout_s
        self._sync: httpx.Client | None = None  # one pool for the probe's calls (a client each: ~50 ms)
        self._sync_lock = threading.Lock()
        self._async: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None

    # ---- blocking (the start-up probe) ----
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._post(text_body(self.model, text, add_special_tokens), "prompt")

    def encode_chat(self, messages: list[dict], fields: dict | None = None) -> list[int]:
        return self._post(chat_body(self.model, messages, fields), "messages")

    def _post(self, body: dict, what: str) -> list[int]:
        try:
            r = self._sync_client().post("/tokenize", json=body)
        except httpx.HTTPError as e:
            raise _unreachable(self.url, e) from None
        return _tokens(self.url, r, what)

    def _sync_client(self) -> httpx.Client:
        with self._sync_lock:  # the probe asks from several threads (an httpx.Client is thread-safe)
            if self._sync is None:
                self._sync = httpx.Client(base_url=self.url, timeout=self.timeout_s)
            return self._sync

    def close_blocking(self) -> None:
        """Close the probe's connections (the async client stays for requests)."""
        with self._sync_lock:
            if self._sync is not None:
                self._sync.close()
                self._sync = None

    def vocab_size(self) -> int | None:
        """The decode model's vocabulary size (vLLM accepts prompt ids below it, and up to its
        tokenizer's largest id), or None if it does not say. vLLM serves it nowhere without dev mode
        except in the error that refuses a ``logit_bias`` id outside it, which is checked before any
        compute: ask with an id no vocabulary has."""
        body = {"model": self.model, "prompt": [0], "max_tokens": 1, "logit_bias": {str(2**31 - 1): 0}}
        try:
            r = self._sync_client().post("/v1/completions", json=body)
        except httpx.HTTPError:
            return None
        hit = _VOCAB_RE.search(r.text) if r.status_code == 400 else None
        return int(hit.group(1)) if hit else None

    # ---- async (each request, with --tokenizer-parity decode) ----
    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._post_async(text_body(self.model, text, add_special_tokens), "prompt")

    async def encode_chat_async(self, messages: list[dict], fields: dict | None = None) -> list[int]:
        return await self._post_async(chat_body(self.model, messages, fields), "messages")

    async def _post_async(self, body: dict, what: str) -> list[int]:
        try:
            r = await self._client().post("/tokenize", json=body)
        except httpx.HTTPError as e:
            raise _unreachable(self.url, e) from None
        return _tokens(self.url, r, what)

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async[0] is not loop:
            self._async = (loop, httpx.AsyncClient(base_url=self.url,
                                                   timeout=httpx.Timeout(self.request_timeout_s, connect=10.0)))
        return self._async[1]


class ThroughDecode:
    """``--tokenizer-parity decode``: every text prompt and chat is tokenized by a decode, the first
    that answers (all were probed to tokenize alike) and is not held out (it came back tokenizing
    otherwise: ``hold_out``). Each call is timed; failures are counted."""

    def __init__(self, decodes: list[DecodeTokenizer], metrics):
        assert decodes, "tokenizing through the decode needs a decode"
        self.decodes, self.metrics = list(decodes), metrics
        self._held: set[str] = set()  # urls

    def hold_out(self, url: str, held: bool) -> None:
        """Whether the decode at ``url`` may tokenize requests (its re-admission probe decides)."""
        (self._held.add if held else self._held.discard)(url.rstrip("/"))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._call(lambda d: d.encode_async(text, add_special_tokens))

    async def encode_chat(self, messages: list[dict], fields: dict | None = None) -> list[int]:
        return await self._call(lambda d: d.encode_chat_async(messages, fields))

    async def _call(self, ask) -> list[int]:
        t0 = time.perf_counter()
        last: DecodeUnavailable | None = None
        for d in self.decodes:
            if d.url in self._held:
                last = last or DecodeNotReached(f"the decode at {d.url} is held out: it came back tokenizing "
                                                "otherwise than at start-up")
                continue
            try:
                ids = await ask(d)
            except DecodeNotReached as e:  # nothing reached it: the next decode tokenizes alike
                last = e
                continue
            except DecodeUnavailable:
                self.metrics.tokenize_remote_failed.inc()
                raise
            self.metrics.tokenize_remote.observe(time.perf_counter() - t0)
            return ids
        self.metrics.tokenize_remote_failed.inc()
        assert last is not None
        raise DecodeUnavailable(f"{last.message}; with --tokenizer-parity decode a prompt is tokenized by a "
                                "decode: retry once one is up")

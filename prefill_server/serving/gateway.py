"""The prefill-then-decode policy for one OpenAI request: tokenize, check it fits the decode,
prefill here, decide who samples the first token, call the decode with ``kv_transfer_params`` and
relay its answer (a stream: ``stream_relay.py``). ``http.py`` translates HTTP to and from these
calls and nothing more.

A request's outcome is counted once (``prefill_server:requests_total{outcome}``): ``ok`` only when
the decode's answer reached the client whole (a stream: up to its ``[DONE]``), ``cancelled`` when the
client went away (the awaiting task is cancelled: the engine aborts the prefill and frees its
blocks, an open decode request is closed, and vLLM aborts it), else the error's class.

Who frees the KV: the decode, by reading it (nixl-compat) or registering for it (connector); the
gateway releases it at once whenever the decode will not (unreachable, refused, client gone), and
after the answer when the decode may not have read it (a connector-mode pull that its prefix cache
made unnecessary).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prefill_server.engine.worker import Route, SamplingParams
from prefill_server.errors import (DecodeNotReached, DecodeUnavailable, InvalidRequest, PrefillError, PromptMismatch,
                                   PromptTooLong)
from prefill_server.serving import first_draw
from prefill_server.serving import first_token as ft
from prefill_server.serving import local_answer
from prefill_server.serving import openai_schema as schema
from prefill_server.serving import prefill_instance as pi
from prefill_server.serving import sglang_prefill as sp
from prefill_server.serving.relay import (chain, check_prompt_tokens, consume, decode_failure, decode_outcome,
                                          ended_cached_tokens, max_tokens_of, one_token_answer,
                                          raise_prefill_failure, renamer, streamed_cached_tokens)
from prefill_server.serving.stream_relay import StreamUsage, relay
from prefill_server.serving.decodes import Assignment, DecodeSet
from prefill_server.serving.lease_keeper import LeaseKeeper
from prefill_server.serving.service import PrefillService

log = logging.getLogger(__name__)


@dataclass
class Answer:
    """A whole answer: a JSON object, or the decode's own JSON bytes with its status."""

    body: dict | bytes
    status: int = 200


@dataclass
class Stream:
    """Server-sent events, each ``data: ...\\n\\n``; the last is ``data: [DONE]``."""

    events: AsyncIterator[bytes]


class _Outcome:
    """A request's outcome, counted once: the first record wins (a stream records its own end)."""

    def __init__(self, metrics):
        self._metrics, self.value = metrics, None

    def record(self, value: str) -> None:
        if self.value is None:
            self.value = value
            self._metrics.requests.labels(value).inc()


@dataclass
class _Call:
    """One request on its way to the decode."""

    path: str
    body: dict
    request_id: str
    params: dict
    num_prompt_tokens: int  # the prefill's (the decode's prompt has one more with ``first``)
    stream: bool
    t0: float
    outcome: _Outcome
    decode: Assignment
    prefill: asyncio.Future | None = None  # connector push: the prefill running beside the decode
    first: ft.FirstToken | None = None
    release_after: bool = False
    cached_tokens: int | None = None  # the prefill's prefix-cache hit (None: no prefix cache)
    usage: StreamUsage | None = None  # a stream from a vLLM decode: its usage, checked and cut (stream_relay.py)

    @property
    def decode_prompt_tokens(self) -> int:
        """The prompt the decode must count: ours, and t1 with ``first`` (sampled here, appended)."""
        return self.num_prompt_tokens + (1 if self.first else 0)


class Gateway:
    def __init__(self, service: PrefillService, decodes: DecodeSet | None):
        self.service, self.decodes = service, decodes  # decodes None: transfer mode "local"
        self.metrics = service.metrics
        self.leases = LeaseKeeper(service.keep, service.info.lease_ttl_s)  # held while a decode call is open

    # ---- entry points ----
    async def completion(self, raw: dict, tag: str | None = None) -> Answer | Stream:
        """``tag``: the caller's request id (HTTP ``X-Request-Id``), for the logs."""
        outcome = _Outcome(self.metrics)
        return await self._failing_rooms(raw, self._counted(self._completion(raw, outcome, tag), outcome))

    async def chat(self, raw: dict, tag: str | None = None) -> Answer | Stream:
        outcome = _Outcome(self.metrics)
        return await self._failing_rooms(raw, self._counted(self._chat(raw, outcome, tag), outcome))

    async def generate(self, raw: dict, tag: str | None = None) -> Answer | Stream:
        """SGLang's native ``POST /generate`` (SGLang decodes only): as their prefill when it
        carries a room, else sent on to a decode as sglang-router would."""
        outcome = _Outcome(self.metrics)
        return await self._failing_rooms(raw, self._counted(self._generate(raw, outcome, tag), outcome))

    async def _failing_rooms(self, raw: dict, work) -> Answer | Stream:
        """A request with SGLang rooms that fails here: the decodes the router sent it to fail its
        rooms at once (``refuse_room``) instead of waiting 300 s for KV that will not come."""
        try:
            return await work
        except BaseException as e:
            if self.service.backend.bootstrap_port is not None:
                why = e.message if isinstance(e, PrefillError) else (
                    "the request was cancelled at the prefill (its client went away)"
                    if isinstance(e, asyncio.CancelledError) else f"the prefill failed ({type(e).__name__})")
                for room in sp.rooms_in(raw):
                    self.service.refuse_room(room, why)
            raise

    async def _generate(self, raw: dict, outcome: _Outcome, tag: str | None) -> Answer | Stream:
        svc = self.service
        if svc.backend.bootstrap_port is None:
            raise InvalidRequest("POST /generate is SGLang's native API, served with --decode-engine sglang; this "
                                 "server prefills for vLLM decodes: use /v1/completions", field="path")
        g = sp.parse_generate(raw, svc.eos_token_ids, svc.info.vocab_size)
        svc.worker.check_admission()  # (before tokenizing: a full server answers 429 at once)
        token_ids = g.input_ids or await svc.encode_prompt_async(g.text)
        self._check_fits(len(token_ids), g.max_new_tokens)
        if (room := self._room_of(raw)) is not None:
            return await self._for_sglang_decode(None, raw, room, token_ids, g.sampling, g.stream, outcome, tag, g)
        out = {k: v for k, v in raw.items() if k != "text"} | {"input_ids": token_ids}
        return await self._run("/generate", out, token_ids, g.sampling, g.stream, None, outcome, tag)

    async def _completion(self, raw: dict, outcome: _Outcome, tag: str | None) -> Answer | Stream:
        svc = self.service
        body = schema.parse(schema.CompletionBody, raw)
        remote_decode = self._wants_remote_decode(raw)
        self._check_model(raw, body.model)
        svc.worker.check_admission()
        # (add_special_tokens: as vLLM's completion endpoint takes it, true unless false)
        token_ids = await svc.encode_prompt_async(schema.single_prompt(body.prompt),
                                                  add_special_tokens=raw.get("add_special_tokens") is not False)
        self._check_fits(len(token_ids), body.max_tokens, body.truncate_prompt_tokens)
        sampling = self._sampling(body, raw)
        if remote_decode:
            return await self._as_prefill_instance(False, raw, token_ids, sampling, body.stream, outcome, tag)
        if (room := self._room_of(raw)) is not None:
            return await self._for_sglang_decode(False, raw, room, token_ids, sampling, body.stream, outcome, tag)
        out = dict(raw, prompt=token_ids)  # the decode gets exactly the tokens we prefilled
        return await self._run("/v1/completions", out, token_ids, sampling, body.stream,
                               self._plan("completion", raw), outcome, tag)

    async def _chat(self, raw: dict, outcome: _Outcome, tag: str | None) -> Answer | Stream:
        svc = self.service
        body = schema.parse(schema.ChatBody, raw)
        remote_decode = self._wants_remote_decode(raw)
        self._check_model(raw, body.model)
        svc.worker.check_admission()
        token_ids = await svc.encode_chat_async(schema.chat_messages(body), request=raw)
        self._check_fits(len(token_ids), body.max_completion_tokens or body.max_tokens, body.truncate_prompt_tokens)
        sampling = self._sampling(body, raw)
        if remote_decode:
            return await self._as_prefill_instance(True, raw, token_ids, sampling, body.stream, outcome, tag)
        if (room := self._room_of(raw)) is not None:
            return await self._for_sglang_decode(True, raw, room, token_ids, sampling, body.stream, outcome, tag)
        return await self._run("/v1/chat/completions", dict(raw), token_ids, sampling, body.stream,
                               self._plan("chat", raw), outcome, tag)

    def _wants_remote_decode(self, raw: dict) -> bool:
        """A PD router's request to its prefill (``kv_transfer_params.do_remote_decode``), which
        only a mode whose KV a stock vLLM decode reads can answer."""
        if not pi.wants_remote_decode(raw):
            return False
        if not self.service.backend.serves_pd_routers:
            raise InvalidRequest(f"kv_transfer_params.do_remote_decode asks for a prefill instance's answer "
                                 f"(a PD router's request), which this server, in transfer mode "
                                 f"{self.service.backend.name}, does not give: run it with --transfer-mode "
                                 "nixl-compat", field="kv_transfer_params.do_remote_decode")
        return True

    def _room_of(self, raw: dict) -> int | None:
        """An SGLang PD request's ``bootstrap_room`` (sglang-router's request to its prefill), checked.
        With SGLang decodes the first token is always ours: sampling we do not apply is refused."""
        backend = self.service.backend
        if backend.reads_first_token:
            sp.check_sampling(raw)
        return sp.room_of(raw, backend.bootstrap_port)

    def _sampling(self, body: schema._Body, raw: dict) -> SamplingParams:
        """How the first token is drawn (it is the client's with SGLang decodes and without a decode)."""
        svc = self.service
        return first_draw.openai_sampling(body, raw, svc.eos_token_ids, svc.info.vocab_size,
                                          sglang=svc.backend.reads_first_token, tokenizer=svc.tokenizer)

    def _check_model(self, raw: dict, name: str | None) -> None:
        # sglang-router names a chat without "model" "unknown" (and /generate's null) to its workers
        if name == "unknown" and raw.get("bootstrap_room") is not None:
            return
        self.service.check_model(name)

    # ---- checks ----
    def _check_fits(self, n: int, max_tokens: int | None, truncate: int | None = None) -> None:
        """The decode refuses a prompt that leaves its context no room: refuse it before computing.
        ``truncate`` (``truncate_prompt_tokens``): the decode would cut a longer prompt to that many
        tokens, after our KV was made for all of them, so a prompt it would cut is refused here."""
        if truncate is not None and truncate >= 0 and n > truncate:
            raise InvalidRequest(f"truncate_prompt_tokens={truncate} would cut this {n}-token prompt, which the "
                                 "prefill server does not do (the decode would then continue from KV of another "
                                 "prompt): send the prompt already cut to the tokens you want kept",
                                 field="truncate_prompt_tokens")
        limit = self.service.info.max_model_len
        where = self.service.info.max_model_len_source
        if n >= limit:
            raise PromptTooLong(f"the prompt has {n} tokens and the context is {limit} ({where}), which "
                                "leaves no room for an answer: shorten the prompt", field="prompt")
        if max_tokens is not None and n + max_tokens > limit:
            raise PromptTooLong(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} "
                                f"tokens, more than the context of {limit} ({where}): shorten the prompt or "
                                f"ask for at most {limit - n} tokens", field="max_tokens")

    def _plan(self, kind: str, raw: dict) -> ft.Plan | None:
        svc = self.service
        if svc.first_token != "prefill" or self.decodes is None:
            return None
        return ft.plan(kind, raw)

    # ---- outcome ----
    @staticmethod
    async def _counted(work, outcome: _Outcome) -> Answer | Stream:
        try:
            answer = await work
        except asyncio.CancelledError:
            outcome.record("cancelled")
            raise
        except PrefillError as e:
            outcome.record(type(e).__name__)
            raise
        except BaseException:
            outcome.record("InternalError")
            raise
        if isinstance(answer, Answer):
            outcome.record("ok" if answer.status < 400 else decode_outcome(answer.status))
        return answer

    # ---- the policy ----
    async def _as_prefill_instance(self, chat: bool, raw: dict, token_ids: list[int], sampling: SamplingParams,
                                   stream: bool, outcome: _Outcome, tag: str | None) -> Answer | Stream:
        """Prefill, keep the KV under a lease for the router's decode, answer one token and the
        kv_transfer_params it forwards (``prefill_instance.py``)."""
        svc = self.service
        result = await svc.prefill(token_ids, sampling, cache_salt=raw.get("cache_salt"))
        rid = result.request_id
        try:
            answer = one_token_answer(svc, chat, result, token_ids,
                                      svc.params_for_prompt(result.kv_transfer_params, len(token_ids)))
        except BaseException:
            svc.release(rid)
            raise
        log.info("request %s%s: prefilled %d tokens as a prefill instance; KV leased for the router's decode",
                 rid, f" (X-Request-Id {tag})" if tag else "", len(token_ids))
        if not stream:
            return Answer(answer.body())
        include_usage = bool((raw.get("stream_options") or {}).get("include_usage"))

        def on_end(sent: bool) -> None:
            if not sent:  # the router never had the params: nobody will read the KV
                svc.release(rid)
                self.metrics.kv_failed.inc()
            outcome.record("ok" if sent else "cancelled")
        return Stream(pi.events(answer.chunks(include_usage), on_end))

    async def _for_sglang_decode(self, chat: bool | None, raw: dict, room: int, token_ids: list[int],
                                 sampling: SamplingParams, stream: bool, outcome: _Outcome,
                                 tag: str | None, generate: sp.Generate | None = None) -> Answer | Stream:
        """SGLang's prefill role: the router sent the decode the same request with the same room;
        stream the KV into the pages it pre-allocated and answer with the first token once its
        status went out (``generate``: a /generate request, answered in its shape). The router
        going away aborts it: the decode gets a failed status."""
        svc = self.service
        k = generate.num_logprobs if generate else sp.requested_logprobs("/v1/chat/completions" if chat else "", raw)
        rid, _, prefill = await svc.start_stream(token_ids, sampling, bootstrap_room=room, num_logprobs=k,
                                                 cache_salt=raw.get("cache_salt"))
        try:
            result = await prefill
        except BaseException:
            svc.release(rid)
            raise
        log.info("request %s%s: prefilled %d tokens for SGLang bootstrap_room %d", rid,
                 f" (X-Request-Id {tag})" if tag else "", len(token_ids), room)
        if generate is not None:
            t = result.first_token_id
            body = sp.generate_answer(generate, rid, t, sp.first_text(svc.tokenizer, generate, token_ids, t),
                                      t in svc.eos_token_ids,
                                      result.num_prompt_tokens, result.num_cached_tokens, result.first_logprobs)
            if not stream:
                return Answer(body)
            return Stream(pi.events([body], lambda sent: outcome.record("ok")))
        answer = one_token_answer(svc, bool(chat), result, token_ids)
        if not stream:
            return Answer(answer.body())
        include_usage = bool((raw.get("stream_options") or {}).get("include_usage"))
        return Stream(pi.events(answer.chunks(include_usage), lambda sent: outcome.record("ok")))

    async def _run(self, path: str, out: dict, token_ids: list[int], sampling: SamplingParams, stream: bool,
                   plan: ft.Plan | None, outcome: _Outcome, tag: str | None = None) -> Answer | Stream:
        svc, t0 = self.service, time.monotonic()
        if self.decodes is None:  # no decode to send it to: answer with the first token only
            if svc.backend.bootstrap_port is not None:
                raise InvalidRequest("this server is the prefill for SGLang decodes behind a PD router (started "
                                     "without --decode-url): send requests with bootstrap_host, bootstrap_port and "
                                     "bootstrap_room (sglang-router --pd-disaggregation adds them), or start it "
                                     "with --decode-url", field="bootstrap_room")
            if svc.backend.needs_decode and (stream or max_tokens_of(out) != 1):
                raise InvalidRequest("this server is a prefill instance for a PD router (started without "
                                     "--decode-url): send requests with kv_transfer_params.do_remote_decode=true "
                                     "(as vllm-router, vLLM's proxy and llm-d do), or max_tokens=1 without "
                                     "streaming for the first token alone; or start it with --decode-url",
                                     field="kv_transfer_params")
            who = ("a prefill instance asked for its first token alone (--decode-url gives it a decode)"
                   if svc.backend.needs_decode else "a server without a decode (--decode-url gives it one)")
            p = local_answer.plan("chat" if path.endswith("chat/completions") else "completion", out, who)
            result = await svc.prefill(token_ids, sampling, num_logprobs=p.num_logprobs,
                                       cache_salt=out.get("cache_salt"))
            svc.release(result.request_id)
            answer = local_answer.LocalAnswer(p, svc.tokenizer, svc.eos_token_ids, token_ids, result,
                                              svc.info.served_name)
            if not stream:
                return Answer(answer.body())
            return Stream(answer.events(lambda: outcome.record("ok")))
        if tag:
            log.info("request with X-Request-Id %s: %d prompt tokens", tag, len(token_ids))
        # the decode first: none up fails before computing anything, and a pull-mode KV is
        # published for the decode that will read it
        decode = self.decodes.assign()
        try:
            return await self._prefill_then_decode(path, out, token_ids, sampling, stream, plan, outcome,
                                                   decode, t0)
        except BaseException:
            decode.end()  # (idempotent: the request may have ended it, or moved to another decode)
            raise

    async def _prefill_then_decode(self, path: str, out: dict, token_ids: list[int], sampling: SamplingParams,
                                   stream: bool, plan: ft.Plan | None, outcome: _Outcome, decode: Assignment,
                                   t0: float) -> Answer | Stream:
        svc, backend = self.service, self.service.backend
        route = backend.route(plan is not None, svc.fits_whole(len(token_ids)))
        if route is Route.STREAM:
            return await self._run_stream(path, out, token_ids, sampling, stream, t0, outcome, decode)
        result = await svc.prefill(token_ids, sampling, num_logprobs=plan.num_logprobs if plan else None,
                                   route=route, room_tokens=backend.room_tokens(route, plan is not None),
                                   decode_url=decode.decode.url, cache_salt=out.get("cache_salt"))
        first = plan and ft.first_token(plan, svc.tokenizer, svc.eos_token_ids, token_ids,
                                        result.first_token_id, result.first_logprobs, svc.info.max_model_len)
        cached = result.num_cached_tokens if svc.info.prefix_cache else None
        if first:
            first = dataclasses.replace(first, cached_tokens=cached)
        self.metrics.first_token.labels("prefill" if first else "decode").inc()
        params = svc.params_for_prompt(result.kv_transfer_params, len(token_ids) + (1 if first else 0))
        if first:  # the decode continues from prompt + [t1] (serving/first_token.py)
            path, out = "/v1/completions", first.decode_body(token_ids, svc.info.served_name, params)
        # LEASE_FOR_LATER: the decode's pull may be unnecessary (its own prefix cache): release after
        return await self._to_decode(_Call(path, out, result.request_id, params, len(token_ids), stream, t0,
                                           outcome, decode, first=first or None,
                                           release_after=route is Route.LEASE_FOR_LATER, cached_tokens=cached))

    async def _run_stream(self, path: str, out: dict, token_ids: list[int], sampling: SamplingParams,
                          stream: bool, t0: float, outcome: _Outcome, decode: Assignment) -> Answer | Stream:
        """Route STREAM: decode and prefill at once; the decode's connector registers its blocks
        with the prefill, which WRITEs each layer as it is computed; the decode answers."""
        svc = self.service
        k = sp.requested_logprobs(path, out) if svc.backend.reads_first_token else None
        rid, params, prefill = await svc.start_stream(token_ids, sampling, num_logprobs=k,
                                                      cache_salt=out.get("cache_salt"))
        prefill.add_done_callback(consume)
        return await self._to_decode(_Call(path, out, rid, params, len(token_ids), stream, t0, outcome, decode,
                                           prefill))

    async def _send(self, c: _Call):
        """Post (or open the stream of) ``c`` to its decode. A decode that was not reached is marked
        down and the request goes to another of its group (nothing reached the first one, and the
        same kv_transfer_params work there); a decode that answered is never sent it again."""
        tried = [c.decode.decode]
        while True:
            client = c.decode.decode.client
            if c.decode.decode.model:  # (--served-model-name may name the model otherwise here)
                c.body["model"] = c.decode.decode.model
            try:
                if c.stream:
                    return await client.open_stream(c.path, c.body)
                return await client.post(c.path, c.body)
            except DecodeNotReached as e:
                nxt = self.decodes.reassign(c.decode, e.message, tried)
                if nxt is None:
                    raise
                log.warning("request %s: %s; sending it to %s", c.request_id, e.message, nxt.decode.url)
                c.decode = nxt
                tried.append(nxt.decode)

    async def _to_decode(self, c: _Call) -> Answer | Stream:
        """Send the request to the decode with kv_transfer_params and relay its answer. Whenever
        the decode will not use our KV (unreachable, refused, client gone), free it at once."""
        svc = self.service
        svc.backend.to_decode(c.body, c.params)
        c.body.setdefault("model", svc.info.served_name)
        if c.stream and svc.backend.bootstrap_port is None:  # a vLLM decode's stream: checked as an answer is
            c.usage = StreamUsage.ask(c.body, c.decode_prompt_tokens, c.request_id)
            if c.usage and svc.info.prefix_cache and not c.first:  # (t1 ahead: StreamState adds it)
                c.usage.cached_tokens = (lambda: c.cached_tokens) if c.prefill is None else \
                    (lambda: ended_cached_tokens(c.prefill))
        self.leases.hold(c.request_id)  # (dropped when the call ends: here, or where its stream ends)
        relaying = False
        try:
            resp = await self._send(c)
            if not c.stream:
                c.decode.end()  # the whole answer is in
            elif resp.status_code >= 400:
                content = await resp.aread()
                await resp.aclose()
                if resp.status_code >= 500:
                    raise decode_failure(c.decode.decode.url, resp.status_code, content)
                svc.release(c.request_id)
                c.decode.end()
                return Answer(content, resp.status_code)
            else:
                events = relay(self, resp, c)
                first = await events.__anext__()  # started: its cleanup runs however the stream ends
                relaying = True
                return Stream(chain(first, events))
        except BaseException as e:  # unreachable decode, client gone (a started relay has cleaned up)
            svc.release(c.request_id)
            if not isinstance(e, PromptMismatch):  # (the decode read it, for another prompt: as a whole answer)
                self.metrics.kv_failed.inc()
            if isinstance(e, DecodeUnavailable) and e.marks_down:
                self.decodes.report_unreachable(c.decode.decode, e.message)
            c.decode.end()
            raise
        finally:
            if not relaying:
                self.leases.drop(c.request_id)
        if resp.status_code >= 400:  # the decode refused or failed: it will not use our KV
            svc.release(c.request_id)
            self.metrics.kv_failed.inc()
            await raise_prefill_failure(c.prefill)
            if resp.status_code >= 500:
                raise decode_failure(c.decode.decode.url, resp.status_code, resp.content)
        self.metrics.e2e_time.observe(time.monotonic() - c.t0)
        if c.release_after:
            svc.release(c.request_id)
        if c.prefill is not None and svc.info.prefix_cache:
            c.cached_tokens = await streamed_cached_tokens(c.prefill)
        try:
            body = resp.json()  # (once: the checks and the answer share it)
        except ValueError:  # not JSON: relayed as it came
            body = None
        try:
            check_prompt_tokens(body, c.decode_prompt_tokens, c.request_id)
        except PromptMismatch:
            svc.release(c.request_id)  # (its answer is not the client's: nothing is to read our KV now)
            raise
        served = svc.info.served_name  # (the answer names the model as clients do here, not as the decode)
        if c.first and resp.status_code < 400:
            return Answer(c.first.merge(body if body is not None else resp.json()) | {"model": served})
        if c.cached_tokens is not None and resp.status_code < 400 \
                and isinstance(body, dict) and isinstance(body.get("usage"), dict):
            return Answer({**body, "usage": ft.with_cached_tokens(body["usage"], c.cached_tokens), "model": served})
        return Answer(renamer(c.decode.decode.model, served)(resp.content), resp.status_code)

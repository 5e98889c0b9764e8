"""Tokenizer parity with the decodes (serving/token_parity.py, serving/decode_tokenizer.py): the
probe's report, the three policies and their messages, tokenizing through the decode (HTTP and
gRPC), and the decode's vocabulary for prompts sent as ids. The decode here is a stand-in for
vLLM 0.32's ``POST /tokenize`` running the embedded SmolLM2 tokenizer, optionally altered; the
real vLLM tokenizer is checked in the slow test at the end and in tests/e2e/test_tokenizer_parity.py.

Why this file is long: every part (probe, policies, tokenizing through the decode, re-probing a
decode back from down) runs against the one stand-in decode defined here."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import subprocess
import unicodedata

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from kv_transfer.vllm.discovery import DecodeFacts, declared
from prefill_server.config import EngineConfig, ServerConfig
from prefill_server.errors import DecodeUnavailable, InvalidRequest
from prefill_server.metrics import Metrics
from prefill_server.models.registry import resolve_model
from prefill_server.models.tokenizer import Tokenizer
from prefill_server.serving import token_parity as tp
from prefill_server.serving.background import BackgroundServer
from prefill_server.serving.decode_tokenizer import DecodeTokenizer, ThroughDecode, chat_fields
from prefill_server.serving.http import create_app
from prefill_server.serving.service import PrefillService

VOCAB = 49152


class StandInDecode:
    """vLLM 0.32's /tokenize (and the logit_bias refusal that says its vocabulary) over a tokenizer.
    alter: "nfc" normalizes text first (a tokenizer with a normalizer ours lacks); "shift" adds 1
    to every id after the first (any other tokenizer); "no-tokenize": 404, as a server without it."""

    def __init__(self, tokenizer: Tokenizer, alter: str | None = None):
        self.tok, self.alter, self.bodies, self.healthy = tokenizer, alter, [], True
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.post("/tokenize")
        async def tokenize(request: Request):
            body = await request.json()
            self.bodies.append(body)
            if self.alter == "no-tokenize":
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            try:
                if "messages" in body:
                    kwargs = dict(body.get("chat_template_kwargs") or {})
                    if body.get("tools"):
                        kwargs["tools"] = body["tools"]
                    text = self.tok.apply_chat_template(body["messages"], body.get("add_generation_prompt", True),
                                                        **kwargs)
                    ids = self._encode(text, body.get("add_special_tokens", False))
                else:
                    ids = self._encode(body["prompt"], body.get("add_special_tokens", True))
            except InvalidRequest as e:
                return JSONResponse({"error": {"message": e.message, "type": "BadRequestError", "code": 400}},
                                    status_code=400)
            return {"count": len(ids), "max_model_len": 8192, "tokens": ids, "token_strs": None}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            bad = [int(k) for k in body.get("logit_bias") or {} if not 0 <= int(k) < VOCAB]
            return JSONResponse({"error": {"message": f"token_id(s) {bad} in logit_bias contain out-of-vocab "
                                           f"token ids. Vocabulary size: {VOCAB}", "code": 400}}, status_code=400)

        self.server = BackgroundServer(app)
        self.url = self.server.url

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.alter == "nfc":
            text = unicodedata.normalize("NFC", text)
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens)
        return ids[:1] + [t + 1 for t in ids[1:]] if self.alter == "shift" else ids

    def __enter__(self) -> StandInDecode:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(None))


@pytest.fixture()
def decode(tokenizer, request):
    with StandInDecode(tokenizer, getattr(request, "param", None)) as d:
        yield d


def client_of(d: StandInDecode) -> DecodeTokenizer:
    return DecodeTokenizer(d.url, "m")


# ---- the probe ----
def test_the_probe_covers_what_tokenizers_differ_on(tokenizer):
    cases = tp.cases(tokenizer)
    texts = " ".join(c.text for c in cases if c.text)
    for needle in ("def f(n):\n    ...", "   ", "\n\n\n", "\t", "日本語", "🙂", "1234567890", "<|im_end|>",
                   "supercalifragilisticexpialidocious"):
        assert needle in texts, needle
    assert any(not c.add_special_tokens for c in cases)
    chats = [c for c in cases if c.messages]
    assert {m["role"] for c in chats for m in c.messages} >= {"system", "user", "assistant"}
    assert any(len(c.messages) >= 3 for c in chats)
    assert not any(c.tools for c in chats)  # SmolLM2's template renders no tools

    class WithTools:
        special_tokens, chat_template = {}, "{% if tools %}{{ tools }}{% endif %}"
    assert any(c.tools for c in tp.cases(WithTools()))


def test_same_tokenizer_is_parity_and_says_its_vocabulary(tokenizer, decode):
    r = tp.probe(tokenizer, client_of(decode))
    assert r.same and r.difference is None and r.error is None, r
    assert r.cases == len(tp.cases(tokenizer)) and r.vocab_size == VOCAB
    assert r.seconds < 2.0
    chat = next(b for b in decode.bodies if "messages" in b)
    assert chat["add_generation_prompt"] is True and chat["model"] == "m"
    assert {b.get("add_special_tokens") for b in decode.bodies if "prompt" in b} == {True, False}


@pytest.mark.parametrize("decode", ["nfc"], indirect=True)
def test_a_normalizer_ours_lacks_is_found_with_its_first_differing_token(tokenizer, decode):
    r = tp.probe(tokenizer, client_of(decode))
    d = r.difference
    assert d is not None and not r.same and "combining" in d.case
    assert d.position is not None and d.ours[:d.position] == d.theirs[:d.position]
    assert d.ours[d.position] != d.theirs[d.position]
    text = d.describe(tokenizer)
    assert f"at token {d.position}" in text and str(d.ours[d.position]) in text and str(d.theirs[d.position]) in text


@pytest.mark.parametrize("decode", ["shift"], indirect=True)
def test_refuse_names_the_difference_and_the_fixes(tokenizer, decode, caplog):
    with pytest.raises(tp.TokenizerMismatch) as e:
        tp.check_fleet(tokenizer, [client_of(decode)], "refuse", "/models/x")
    msg = str(e.value)
    assert decode.url in msg and "/models/x" in msg and "'Hello, world!'" in msg and "first difference" in msg
    assert "--tokenizer-parity decode" in msg and "--tokenizer-parity warn" in msg and "--chat-template" in msg
    assert isinstance(e.value, ValueError)  # the CLI prints it as "error: ..." and exits 1


@pytest.mark.parametrize("decode", ["shift"], indirect=True)
def test_warn_serves_with_our_tokens_and_decode_tokenizes_there(tokenizer, decode, caplog):
    with caplog.at_level(logging.WARNING):
        out = tp.check_fleet(tokenizer, [client_of(decode)], "warn")
    assert out.through_decode == () and "tokenizes differently" in caplog.text and "serving anyway" in caplog.text
    out = tp.check_fleet(tokenizer, [client_of(decode)], "decode")
    assert [d.url for d in out.through_decode] == [decode.url] and out.vocab_size == VOCAB
    assert not out.reports[0].same


def test_parity_is_logged_and_decode_policy_still_tokenizes_there(tokenizer, decode, caplog):
    with caplog.at_level(logging.INFO):
        out = tp.check_fleet(tokenizer, [client_of(decode)], "refuse")
    assert out.through_decode == () and out.reports[0].same
    assert f"tokenizer parity with the decode at {decode.url}" in caplog.text
    assert tp.check_fleet(tokenizer, [client_of(decode)], "decode").through_decode


@pytest.mark.parametrize("decode", ["no-tokenize"], indirect=True)
def test_a_decode_without_tokenize_is_unchecked_refused_unless_warn(tokenizer, decode):
    for policy in ("refuse", "decode"):
        with pytest.raises(tp.TokenizerMismatch, match="could not be checked.*no POST /tokenize.*warn"):
            tp.check_fleet(tokenizer, [client_of(decode)], policy)
    out = tp.check_fleet(tokenizer, [client_of(decode)], "warn")
    assert out.reports[0].error and out.vocab_size is None


def test_unreachable_decode_is_unchecked(tokenizer):
    with pytest.raises(tp.TokenizerMismatch, match="could not be checked"):
        tp.check_fleet(tokenizer, [DecodeTokenizer("http://127.0.0.1:9", "m", timeout_s=2)], "refuse")


def test_decodes_that_differ_from_each_other_refuse_even_tokenizing_there(tokenizer):
    with StandInDecode(tokenizer) as a, StandInDecode(tokenizer, "shift") as b:
        with pytest.raises(tp.TokenizerMismatch, match="from each other.*one prefill server per kind"):
            tp.check_fleet(tokenizer, [client_of(a), client_of(b)], "decode")
        with pytest.raises(tp.TokenizerMismatch) as e:
            tp.check_fleet(tokenizer, [client_of(a), client_of(b)], "refuse")
        assert b.url in str(e.value)


def test_first_difference():
    assert tp.first_difference("c", (1, 2), (1, 2)) is None
    assert tp.first_difference("c", (1, 2, 3), (1, 2)).position == 2
    assert tp.first_difference("c", (1, 5), (1, 2, 3)).position == 1
    assert tp.first_difference("c", "refused (a)", "refused (b)") is None  # both refuse the input
    d = tp.first_difference("c", "refused (no template)", (1, 2))
    assert d.position is None and "refused (no template) here, 2 tokens at the decode" in d.describe()


def test_a_pure_prefill_instance_has_nothing_to_probe(caplog):
    from prefill_server.serving.server import check_tokenizers

    facts = declared(vllm_version="0.32.0", model="m", served_model_name="m", attn_backend_name="CPU_ATTN")
    with caplog.at_level(logging.INFO):
        out = check_tokenizers(EngineConfig(), ServerConfig(), (facts,))
    assert out.reports == () and out.through_decode == ()
    assert "no decode to probe" in caplog.text


# ---- tokenizing through the decode ----
def service_through(local_service, decode: StandInDecode | None, vocab: int | None = None,
                    reports: tuple[tp.ParityReport, ...] = ()) -> PrefillService:
    """The local test service's worker, tokenizing through ``decode``."""
    parity = tp.ParityOutcome("decode", reports, (client_of(decode),) if decode else (), vocab)
    s = local_service
    return PrefillService(s.worker, s.tokenizer, s.info, s.backend, first_token=s.first_token, parity=parity)


@pytest.mark.parametrize("decode", ["shift"], indirect=True)
def test_requests_are_tokenized_by_the_decode_timed_in_metrics(local_service, decode):
    svc = service_through(local_service, decode)
    before = _sample(svc.metrics, "prefill_server:tokenize_remote_seconds_count")
    with TestClient(create_app(svc, None)) as c:
        r = c.post("/v1/completions", json={"prompt": "Hello there, world", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(decode._encode("Hello there, world", True))
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                 "chat_template_kwargs": {"k": 1}, "reasoning_effort": "low",
                                                 "add_special_tokens": False})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"prompt": "no specials", "max_tokens": 1, "add_special_tokens": False})
        assert r.status_code == 200, r.text
        assert "prefill_server:tokenize_remote_seconds_bucket" in c.get("/metrics").text
    text, chat, plain = decode.bodies
    assert text == {"model": "m", "prompt": "Hello there, world", "add_special_tokens": True}
    assert chat["messages"] == [{"role": "user", "content": "Hi"}] and chat["add_special_tokens"] is False
    assert chat["chat_template_kwargs"] == {"k": 1, "reasoning_effort": "low", "enable_thinking": True}
    assert plain["add_special_tokens"] is False
    assert _sample(svc.metrics, "prefill_server:tokenize_remote_seconds_count") == before + 3


def _sample(metrics: Metrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_the_decodes_refusal_and_absence_reach_the_client(local_service, tokenizer):
    with StandInDecode(tokenizer, "no-tokenize") as gone:
        svc = service_through(local_service, gone)
        failed = _sample(svc.metrics, "prefill_server:tokenize_remote_failed_total")
        with TestClient(create_app(svc, None)) as c:
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert r.status_code == 502 and "no POST /tokenize" in r.json()["error"]["message"]
        assert _sample(svc.metrics, "prefill_server:tokenize_remote_failed_total") == failed + 1
    svc = service_through(local_service, None)
    svc.through_decode = ThroughDecode([DecodeTokenizer("http://127.0.0.1:9", "m", timeout_s=2)], svc.metrics)
    with pytest.raises(DecodeUnavailable, match="retry once one is up"):
        asyncio.run(svc.encode_prompt_async("hello"))


def test_a_chat_the_decode_refuses_is_a_400(local_service, tokenizer):
    no_template = Tokenizer(resolve_model(None))
    no_template.chat_template = None
    with StandInDecode(no_template) as d:
        svc = service_through(local_service, d)
        with TestClient(create_app(svc, None)) as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and "refused to tokenize the messages" in r.json()["error"]["message"]


def test_parity_per_decode_is_a_gauge(local_service):
    svc = service_through(local_service, None, reports=(tp.ParityReport("http://a"), tp.ParityReport(
        "http://b", difference=tp.Difference("c", (1,), (2,), 0)), tp.ParityReport("http://c", error="gone")))
    text = svc.metrics.render().decode()
    assert 'prefill_server:tokenizer_parity{decode="http://a"} 1.0' in text
    assert 'prefill_server:tokenizer_parity{decode="http://b"} 0.0' in text
    assert 'prefill_server:tokenizer_parity{decode="http://c"} 0.0' in text


def test_the_first_answering_decode_tokenizes(tokenizer):
    with StandInDecode(tokenizer) as d:
        through = ThroughDecode([DecodeTokenizer("http://127.0.0.1:9", "m", timeout_s=2), client_of(d)], Metrics())
        assert asyncio.run(through.encode("Hello")) == tokenizer.encode("Hello")


def test_grpc_follows_the_policy(local_service):
    from prefill_server.serving.grpc_server import PrefillServicer
    from prefill_server.serving.pb import prefill_pb2 as pb

    tok = local_service.tokenizer
    with StandInDecode(tok, "shift") as d:
        servicer = PrefillServicer(service_through(local_service, d, vocab=100))
        p = asyncio.run(servicer._prepare(pb.PrefillRequest(text="Hello there")))
        assert p.token_ids == d._encode("Hello there", True) != tok.encode("Hello there")
        p = asyncio.run(servicer._prepare(pb.PrefillRequest(messages=[pb.ChatMessage(role="user", content="Hi")])))
        assert d.bodies[-1]["messages"] == [{"role": "user", "content": "Hi"}]
        with pytest.raises(InvalidRequest, match="decode's vocabulary"):
            asyncio.run(servicer._prepare(pb.PrefillRequest(token_ids=[1, 2, 100])))


# ---- ids sent as ids ----
# ---- a decode back from down is probed again ----
def _recheck_set(svc: PrefillService, outcome: tp.ParityOutcome, decodes: list[StandInDecode]):
    from prefill_server.serving.decode_client import DecodeClient
    from prefill_server.serving.decodes import Decode, DecodeSet
    from prefill_server.serving.server import parity_recheck

    fleet = tuple(DecodeFacts(url=d.url, vllm_version="0.32.0", model="m", served_model_name="m") for d in decodes)
    admit = parity_recheck(svc, ServerConfig(), outcome, fleet)
    return DecodeSet([Decode(DecodeClient(d.url, 10.0)) for d in decodes], 0.3, svc.metrics, admit=admit)


def _with_parity(local_service, outcome: tp.ParityOutcome) -> PrefillService:
    s = local_service
    return PrefillService(s.worker, s.tokenizer, s.info, s.backend, first_token=s.first_token, parity=outcome)


async def _until(pred, timeout_s: float = 15.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        if pred():
            return True
        await asyncio.sleep(0.05)
    return pred()


def test_a_decode_that_comes_back_tokenizing_otherwise_stays_out_until_it_is_as_before(local_service, tokenizer):
    from prefill_server.errors import DecodeDown

    with StandInDecode(tokenizer) as d:
        outcome = tp.check_fleet(tokenizer, [client_of(d)], "refuse")
        svc = _with_parity(local_service, outcome)

        async def scenario():
            ds = _recheck_set(svc, outcome, [d])
            ds.start()
            try:
                dec = ds.decodes[0]
                d.healthy = False  # the decode restarts: down, then back with another tokenizer
                assert await _until(lambda: not dec.up)
                d.alter, d.healthy = "shift", True
                assert await _until(lambda: dec.held_out)
                assert not dec.up and "came back tokenizing differently from this server" in dec.reason
                with pytest.raises(DecodeDown, match="takes no requests until it tokenizes as before"):
                    ds.assign()
                assert 'tokenizer_parity{decode="%s"} 0.0' % d.url in svc.metrics.render().decode()
                probes = len(d.bodies)
                await asyncio.sleep(1.0)  # kept out: re-probed every interval, never admitted
                assert not dec.up and len(d.bodies) > probes
                d.alter = None  # restarted as it was: taken back
                assert await _until(lambda: dec.up)
                assert not dec.held_out and ds.assign().decode is dec
                assert 'tokenizer_parity{decode="%s"} 1.0' % d.url in svc.metrics.render().decode()
            finally:
                await ds.close()

        asyncio.run(scenario())


def test_warn_takes_a_changed_decode_back_and_says_so(local_service, tokenizer, caplog):
    with StandInDecode(tokenizer) as d:
        outcome = tp.check_fleet(tokenizer, [client_of(d)], "warn")
        svc = _with_parity(local_service, outcome)

        async def scenario():
            ds = _recheck_set(svc, outcome, [d])
            ds.start()
            try:
                ds.report_unreachable(ds.decodes[0], "a request could not reach it")
                d.alter = "shift"
                assert await _until(lambda: ds.decodes[0].up)
            finally:
                await ds.close()

        with caplog.at_level(logging.WARNING):
            asyncio.run(scenario())
        assert "came back tokenizing differently" in caplog.text and "serving anyway" in caplog.text


def test_through_decode_a_decode_back_unlike_the_others_tokenizes_and_serves_nothing(local_service, tokenizer):
    with StandInDecode(tokenizer) as a, StandInDecode(tokenizer) as b:
        outcome = tp.check_fleet(tokenizer, [client_of(b), client_of(a)], "decode")
        svc = _with_parity(local_service, outcome)

        async def scenario():
            ds = _recheck_set(svc, outcome, [a, b])
            ds.start()
            try:
                db = ds.decodes[1]
                ds.report_unreachable(db, "a request could not reach it")
                b.alter = "shift"
                assert await _until(lambda: db.held_out)
                assert f"tokenizing differently from the decode at {a.url}" in db.reason
                b.bodies.clear()
                assert await svc.encode_prompt_async("Hello there") == tokenizer.encode("Hello there")
                assert b.bodies == []  # b is first in the list, but held out: a tokenized it
                assert all(ds.assign().decode is ds.decodes[0] for _ in range(3))
            finally:
                await ds.close()

        asyncio.run(scenario())


def test_ids_are_checked_against_the_decodes_vocabulary(local_service):
    svc = service_through(local_service, None, vocab=1000)
    with TestClient(create_app(svc, None)) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 1000], "max_tokens": 1})
        assert r.status_code == 400
        assert "token id 1000 is outside the decode's vocabulary [0, 1000)" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": [1, 2, 999], "max_tokens": 1}).status_code == 200
        r = c.post("/v1/completions", json={"prompt": [1, -2], "max_tokens": 1})
        assert r.status_code == 400 and "-2" in r.json()["error"]["message"]


def test_chat_fields_render_as_the_chat_endpoint_does():
    assert chat_fields({"messages": [], "max_tokens": 3}) == {}
    assert chat_fields({"tools": [1], "add_generation_prompt": False, "documents": [{"t": 1}],
                        "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}) == {
        "tools": [1], "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": True, "documents": [{"t": 1}], "reasoning_effort": "none"}}
    assert chat_fields({"chat_template_kwargs": "x"}) == {"chat_template_kwargs": "x"}
    assert chat_fields({"reasoning_effort": "auto"}) == {"chat_template_kwargs": {"enable_thinking": True}}


# ---- the real vLLM tokenizer (slow: importing vLLM takes 20-40 s) ----
VLLM_TOKENIZE = r"""
import json, sys
from vllm.tokenizers import get_tokenizer
tok = get_tokenizer(sys.argv[1])
out = []
for case in json.loads(sys.stdin.read()):
    if case.get("text") is not None:
        out.append(tok.encode(case["text"], add_special_tokens=case["add_special_tokens"]))
    else:
        out.append(tok.apply_chat_template(case["messages"], tools=case.get("tools"), add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
print(json.dumps({"class": type(tok).__name__, "ids": out}))
"""


def vllm_tokenize(folder: pathlib.Path, cases: list[tp.Case]) -> dict:
    from prefill_server.local_vllm import DEFAULT_VENV, vllm_python

    if vllm_python() is None:
        pytest.skip("no vLLM venv at .venv-vllm")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"HF_HUB_OFFLINE": "1",
                                                                        "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([str(DEFAULT_VENV / "bin" / "python"), "-c", VLLM_TOKENIZE, str(folder)], env=env,
                       input=json.dumps([c.__dict__ for c in cases]), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def qwen2_typed_folder(tmp_path: pathlib.Path) -> pathlib.Path:
    """SmolLM2's Llama-style BPE tokenizer files under a config.json that says model_type qwen2."""
    src = resolve_model(None)
    out = tmp_path / "qwen2-typed"
    out.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((src / "config.json").read_text()) | {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.slow
def test_the_probe_against_vllms_own_tokenizer_loading(tokenizer, tmp_path):
    """vLLM's get_tokenizer on the embedded model: parity; on the same files typed qwen2: transformers
    picks Qwen2Tokenizer and the probe's code text differs (the issue's case)."""
    cases = tp.cases(tokenizer)
    folder = qwen2_typed_folder(tmp_path)
    for path, same in ((resolve_model(None), True), (folder, False)):
        got = vllm_tokenize(path, cases)
        diffs = [d for c, ids in zip(cases, got["ids"]) if (d := tp.first_difference(c.name, tp._local(tokenizer, c),
                                                                                      tuple(ids)))]
        if same:
            assert diffs == [], [d.describe(tokenizer) for d in diffs]
        else:
            assert got["class"].endswith("Qwen2Tokenizer")
            assert any("def f(n)" in d.case for d in diffs), [d.case for d in diffs]


# ---- the flag ----
def test_the_flag_is_in_help_config_and_validated(capsys):
    from prefill_server import options
    from prefill_server.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--tokenizer-parity {refuse,decode,warn}" in help_text and "(default: refuse)" in help_text
    assert ServerConfig().tokenizer_parity == "refuse"
    s = options.build({"server.tokenizer_parity": "decode", "server.decode_urls": ("http://d:8100",)})
    assert s.server.tokenizer_parity == "decode"
    assert "tokenizer_parity: decode" in options.dump(s)
    with pytest.raises(ValueError, match="needs a --decode-url"):
        options.build({"server.tokenizer_parity": "decode"})
    with pytest.raises(ValueError, match="must be one of refuse, decode, warn"):
        ServerConfig(tokenizer_parity="maybe").validate()

"""The first token's text is what it adds after the prompt, as vLLM's incremental detokenizer shows
it: with a SentencePiece-style tokenizer (Metaspace: "▁world") the word's leading space is part of
it, which decoding the token alone drops. Checked for every answer made of the first token alone:
HTTP without a decode, a prefill instance's answer, gRPC's ``first_token_text``, SGLang's /generate."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from prefill_server.engine.types import PrefillResult
from prefill_server.models.tokenizer import Tokenizer
from prefill_server.serving import first_token as ft
from prefill_server.serving import grpc_server
from prefill_server.serving import sglang_prefill as sp
from prefill_server.serving.grpc_inputs import Prepared
from prefill_server.serving.local_answer import LocalAnswer
from prefill_server.serving.relay import one_token_answer

HELLO, WORLD, EOS = 1, 2, 3


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory) -> Tokenizer:
    t = HFTokenizer(models.WordLevel({"<unk>": 0, "▁Hello": HELLO, "▁world": WORLD, "</s>": EOS}, unk_token="<unk>"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    path = tmp_path_factory.mktemp("metaspace")
    t.save(str(path / "tokenizer.json"))
    tok = Tokenizer(path)
    assert tok.encode("Hello world") == [HELLO, WORLD] and tok.decode([WORLD]) == "world"  # (the space dropped)
    return tok


def _result(token: int) -> PrefillResult:
    return PrefillResult("r1", token, 1, 0, {})


def test_without_a_decode(metaspace):
    a = LocalAnswer(ft.Plan("completion", {}, None, None, False), metaspace, (EOS,), [HELLO], _result(WORLD), "m")
    assert a.body()["choices"][0]["text"] == " world"


def test_a_prefill_instances_answer(metaspace):
    svc = SimpleNamespace(tokenizer=metaspace, eos_token_ids=(EOS,), info=SimpleNamespace(served_name="m"))
    assert one_token_answer(svc, False, _result(WORLD), [HELLO]).text == " world"
    assert one_token_answer(svc, True, _result(EOS), [HELLO]).text == ""


def test_grpc_first_token_text(metaspace):
    servicer = SimpleNamespace(service=SimpleNamespace(tokenizer=metaspace, info=SimpleNamespace(served_name="m")),
                               mode=0)
    p = Prepared("r1", "token_ids", [HELLO], None, 0.0, time.monotonic())
    r = grpc_server.PrefillServicer._response(servicer, p, _result(WORLD), False)
    assert r.first_token_text == " world"
    assert grpc_server.PrefillServicer._response(servicer, p, _result(10**6), False).first_token_text == ""


def test_sglang_generate_answer(metaspace):
    g = sp.parse_generate({"input_ids": [HELLO]}, (), 10)
    assert sp.first_text(metaspace, g, [HELLO], WORLD) == " world"
    assert sp.first_text(metaspace, g, [HELLO], 10**6) == ""


def test_sglang_generate_special_tokens(tmp_path):
    t = HFTokenizer(models.WordLevel({"<unk>": 0, "▁Hello": HELLO, "</s>": EOS}, unk_token="<unk>"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    t.add_special_tokens(["</s>"])
    t.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    assert sp.first_text(tok, sp.parse_generate({"text": "Hello"}, (), 10), [HELLO], EOS) == ""  # SGLang's default skips it
    keep = sp.parse_generate({"text": "Hello", "sampling_params": {"skip_special_tokens": False}}, (), 10)
    assert sp.first_text(tok, keep, [HELLO], EOS) == "</s>"
    with pytest.raises(sp.InvalidRequest, match="skip_special_tokens"):
        sp.parse_generate({"text": "Hello", "sampling_params": {"skip_special_tokens": "no"}}, (), 10)

"""The first token drawn here (a server without a decode; an SGLang decode's first token) is drawn
from what vLLM v1's own ``Sampler`` draws from: each request's sampling fields, through
``first_draw.openai_sampling`` and the engine's sampler, against vLLM 0.32's sampler with its
built-in logits processors (``vllm_serving_reference.py draws``) on the same logits row."""
from __future__ import annotations

import ast
import dataclasses
import math
import pathlib
from typing import Optional

import pytest
import torch

from prefill_server.engine.sampling import draw_logits, sample_first_token
from prefill_server.engine.types import SamplingParams
from prefill_server.errors import InvalidRequest
from prefill_server.serving import first_draw
from prefill_server.serving import openai_schema as schema
from vllm_serving_reference import ask

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB, EOS = 64, 5
PROMPT = [3, 9, 9, 17, 40, 41]


def _row(seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(VOCAB, generator=g) * 3).tolist()


def _ours(params: dict):
    raw = {"prompt": "x", **params}
    return first_draw.openai_sampling(schema.parse(schema.CompletionBody, raw), raw, (EOS,), VOCAB)


def _cases() -> list[tuple[list[float], dict]]:
    rows = [_row(s) for s in range(8)]
    top = [sorted(range(VOCAB), key=r.__getitem__, reverse=True) for r in rows]
    return [
        (rows[0], {"temperature": 0.0, "min_tokens": 1, "stop_token_ids": [top[0][0]]}),
        (rows[1], {"temperature": 0.0, "min_tokens": 2, "max_tokens": 4}),
        (rows[2], {"temperature": 0.0, "repetition_penalty": 1.7}),
        (rows[3], {"temperature": 0.0, "logit_bias": {str(top[3][-1]): 1000, str(top[3][0]): -30.5}}),
        (rows[4], {"temperature": 0.0, "allowed_token_ids": [top[4][7], top[4][3], 60]}),
        (rows[5], {"temperature": 0.7, "min_p": 0.1, "top_k": 10, "top_p": 0.8}),
        (rows[6], {"temperature": 1.3, "repetition_penalty": 0.8, "logit_bias": {"7": 4.0}, "min_tokens": 1,
                   "allowed_token_ids": [7, EOS, 9, 17, 30, 31, 32], "stop_token_ids": [30], "top_p": 0.95}),
        (rows[7], {"temperature": 1.0, "top_p": 0.5}),
    ]


def test_the_first_token_is_drawn_from_what_vllm_draws_from():
    cases = _cases()
    theirs = ask("draws", [{"logits": row, "prompt": PROMPT, "eos": EOS, "params": params} for row, params in cases])
    for (row, params), ref in zip(cases, theirs):
        s = _ours(params)
        x = draw_logits(torch.tensor(row), s, tuple(PROMPT))
        if ref["greedy"] is not None:
            assert sample_first_token(torch.tensor(row), s, tuple(PROMPT)) == ref["greedy"], params
        kept = [i for i, v in enumerate(ref["logits"]) if v is not None]
        assert [i for i in range(VOCAB) if math.isfinite(float(x[i]))] == kept, params
        assert x[kept].tolist() == pytest.approx([ref["logits"][i] for i in kept], rel=1e-5, abs=1e-5), params
        assert all(sample_first_token(torch.tensor(row), s, tuple(PROMPT)) in kept for _ in range(5))


def test_bad_words_keep_their_one_token_forms_from_the_first_token(local_service):
    """vLLM tokenizes each bad word with and without a leading space; a form of one token is banned
    from the first token (longer ones need their first tokens drawn before): against vLLM's own
    ``update_from_tokenizer`` and sampler with the same tokenizer files."""
    tok, vocab = local_service.tokenizer, local_service.info.vocab_size
    path = str(local_service.info.path)
    words = ["Paris", " London", "the capital", "xylophone", "é"]
    one = [tok.encode(w, add_special_tokens=False)[0] for w in (" Paris", "Paris", " London", "London")]
    g = torch.Generator().manual_seed(3)
    row = (torch.randn(vocab, generator=g) * 2)
    row[one] += 40.0  # (the banned forms would win)
    params = {"temperature": 0.0, "bad_words": words}
    (ref,) = ask("draws", [{"logits": row.tolist(), "prompt": PROMPT, "eos": EOS, "params": params,
                            "tokenizer": path}])
    raw = {"prompt": "x", **params}
    s = first_draw.openai_sampling(schema.parse(schema.CompletionBody, raw), raw, (EOS,), vocab, tokenizer=tok)
    assert set(one) <= set(s.banned_token_ids)
    x = draw_logits(row, s, tuple(PROMPT))
    assert sample_first_token(row, s, tuple(PROMPT)) == ref["greedy"]
    assert [i for i in range(vocab) if not math.isfinite(float(x[i]))] == \
        [i for i, v in enumerate(ref["logits"]) if v is None]
    with pytest.raises(InvalidRequest, match="at least one token"):
        first_draw.openai_sampling(schema.parse(schema.CompletionBody, {"prompt": "x", "bad_words": [" "]}),
                                   {}, (EOS,), vocab, tokenizer=tok)


def test_sglang_decodes_count_the_repetition_penalty_on_output_tokens_only():
    raw = {"prompt": "x", "repetition_penalty": 1.5, "logit_bias": {"3": 250}}
    s = first_draw.openai_sampling(schema.parse(schema.CompletionBody, raw), raw, (EOS,), VOCAB, sglang=True)
    assert s.repetition_penalty == 1.0 and s.logit_bias == ((3, 250.0),)  # (and SGLang adds biases unclamped)
    assert s.sampler == "sglang" and _ours({}).sampler == "vllm"


def _sglang_sampler():
    """SGLang 0.5.23's own PyTorch-backend filter (``sampler.top_k_top_p_min_p_sampling_from_probs_torch``),
    its source read from .venv-sglang and run here (its module imports SGLang's server, which that
    venv does not hold)."""
    files = sorted(ROOT.glob(".venv-sglang/lib/python3*/site-packages/sglang/srt/layers/sampler.py"))
    if not files:
        pytest.skip(".venv-sglang is missing (bash scripts/setup_sglang.sh)")
    tree = ast.parse(files[0].read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "top_k_top_p_min_p_sampling_from_probs_torch")
    scope = {"torch": torch, "Optional": Optional}
    exec(compile(ast.Module([fn], []), str(files[0]), "exec"), scope)
    return scope[fn.name]


SGLANG_FILTERS = [{"top_k": 5}, {"top_p": 0.6}, {"top_k": 20, "top_p": 0.7}, {"top_k": 3, "top_p": 0.95},
                  {"min_p": 0.2}, {"top_k": 8, "min_p": 0.05}, {"top_p": 0.8, "min_p": 0.1}, {"top_p": 0.3},
                  {"temperature": 0.5, "top_k": 40, "top_p": 0.5}, {"temperature": 2.0, "top_k": 30, "top_p": 0.9}]


@pytest.mark.parametrize("params", SGLANG_FILTERS)
def test_an_sglang_decodes_first_token_is_drawn_from_what_sglang_draws_from(params):
    """SGLang keeps the tokens inside top-k and inside top-p of the whole distribution (vLLM takes
    top-p of what top-k left: fewer tokens), then min-p: the first token drawn here for an SGLang
    decode comes from the tokens SGLang's own filter keeps. (With top-k, top-p and min-p all set its
    two backends differ: see the next test.)"""
    sglang = _sglang_sampler()
    for seed in range(6):
        row = torch.tensor(_row(100 + seed))
        p = SamplingParams(**{"temperature": 1.0, **params}, sampler="sglang")
        probs = torch.softmax(row / p.temperature, dim=-1)[None]
        _, kept_probs, idx, _ = sglang(probs.clone(), torch.tensor([p.top_k if p.top_k > 0 else VOCAB]),
                                       torch.tensor([p.top_p]), torch.tensor([p.min_p]), p.min_p > 0, None,
                                       torch.tensor([0]), return_filtered_probs=True)
        theirs = sorted(idx[0][kept_probs[0] > 0].tolist())
        x = draw_logits(row, p)
        assert [i for i in range(VOCAB) if math.isfinite(float(x[i]))] == theirs, (params, seed)
        assert all(sample_first_token(row, p) in theirs for _ in range(5))


def test_sglang_with_top_k_top_p_and_min_p_follows_its_default_backend():
    """With all three, SGLang's default (FlashInfer) backend renormalizes after top-k, takes top-p of
    that, then min-p against the largest probability (``top_k_renorm_prob``, ``top_p_renorm_prob``,
    ``min_p_sampling_from_probs``, GPU kernels this machine cannot run: checked against that reading)."""
    row = torch.tensor(_row(7))
    p = SamplingParams(temperature=1.0, top_k=12, top_p=0.6, min_p=0.08, sampler="sglang")
    probs = torch.softmax(row, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    top = probs[order[:12]] / probs[order[:12]].sum()
    n_p = next(i + 1 for i in range(12) if float(top[: i + 1].sum()) >= 0.6)
    want = sorted(t for t in order[:n_p] if probs[t] >= probs[order[0]] * 0.08)
    x = draw_logits(row, p)
    assert [i for i in range(VOCAB) if math.isfinite(float(x[i]))] == want
    vllm = draw_logits(row, dataclasses.replace(p, sampler="vllm"))  # (min-p first, then top-k, top-p)
    assert torch.isfinite(vllm).sum() <= len(want)


@pytest.mark.parametrize("params,field", [
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": "5"}, "stop_token_ids"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, VOCAB + 3]}, "allowed_token_ids"), ({"allowed_token_ids": [1.5]}, "allowed_token_ids"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {"3": "big"}}, "logit_bias"), ({"logit_bias": [3, 1]}, "logit_bias"),
])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(params, field):
    with pytest.raises(InvalidRequest) as e:
        _ours(params)
    assert e.value.field.split(".")[0] == field  # (a list's or an object's entry: "logit_bias.3")


def test_no_token_left_is_a_clear_error_before_any_prefill():
    with pytest.raises(InvalidRequest, match="no token is left") as e:
        _ours({"min_tokens": 1, "allowed_token_ids": [EOS, 7], "stop_token_ids": [7]})
    assert e.value.field == "allowed_token_ids"
    with pytest.raises(InvalidRequest, match="no token is left") as e:
        _ours({"min_tokens": 1, "stop_token_ids": list(range(VOCAB))})
    assert e.value.field == "stop_token_ids"
    _ours({"min_tokens": 1, "stop_token_ids": list(range(1, VOCAB))})  # (token 0 is left)
    s = SamplingParams(temperature=0.0, allowed_token_ids=(EOS,), banned_token_ids=(EOS,))
    with pytest.raises(InvalidRequest, match="allowed"):  # (and the sampler's own guard)
        sample_first_token(torch.tensor(_row(0)), s)

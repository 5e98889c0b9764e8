"""Workloads: reproducible by seed, their length distributions, agent prefixes, needles, traces;
token lengths with a tokenizer."""
from __future__ import annotations

import json

import pytest

from loadtest import workloads as wl
from loadtest.text import TextSource
from loadtest.workloads import WorkloadParams, take


@pytest.fixture(scope="module", params=["licenses", "words"])
def text(request):
    try:
        return TextSource(request.param)
    except FileNotFoundError:
        pytest.skip("no /usr/share/common-licenses on this machine")


SMALL = WorkloadParams(doc_min_tokens=200, doc_max_tokens=2000, rag_system_tokens=100, rag_passage_tokens=50,
                       agent_system_tokens=100, agent_first_tokens=40, agent_turn_tokens=30, agent_reply_tokens=10,
                       long_min_tokens=1000, long_max_tokens=2000)


@pytest.mark.parametrize("name", ["rag", "longdoc", "needle", "agent", "mix"])
def test_same_seed_same_requests_other_seed_other_requests(text, name):
    a = take(name, SMALL, text, seed=7, n=12)
    b = take(name, SMALL, text, seed=7, n=12)
    c = take(name, SMALL, text, seed=8, n=12)
    assert [r.messages for r in a] == [r.messages for r in b]
    assert [r.describe() for r in a] == [r.describe() for r in b]
    assert [r.messages for r in a] != [r.messages for r in c]


def test_longdoc_lengths_within_the_range_and_spread(text):
    p = WorkloadParams()  # the default 8K-128K
    reqs = take("longdoc", p, text, seed=1, n=40)
    targets = [r.tags["target_tokens"] for r in reqs]
    assert all(8192 <= t <= 131072 for t in targets)
    assert all(0.97 * 8192 <= r.prompt_tokens <= 1.03 * 131072 for r in reqs)
    assert all(abs(r.prompt_tokens - r.tags["target_tokens"]) <= 0.03 * r.tags["target_tokens"] + 8 for r in reqs)
    assert min(targets) < 16384 and max(targets) > 65536  # log-uniform: both ends are visited


def test_longdoc_cap_and_the_1m_option(text):
    with pytest.raises(ValueError, match="allow-huge"):
        take("longdoc", WorkloadParams(doc_max_tokens=1 << 20), text, 0, 1)
    big = take("longdoc", WorkloadParams(doc_min_tokens=900_000, doc_max_tokens=1 << 20, allow_huge=True), text, 0, 1)
    assert 0.97 * 900_000 <= big[0].prompt_tokens <= 1.03 * (1 << 20)
    with pytest.raises(ValueError):
        take("longdoc", WorkloadParams(doc_max_tokens=(1 << 20) + 1, allow_huge=True), text, 0, 1)


def test_mix_share_of_long_prompts_and_both_ranges(text):
    p = WorkloadParams(short_min_tokens=20, short_max_tokens=100, long_min_tokens=400, long_max_tokens=800,
                       long_share=0.25)
    reqs = take("mix", p, text, seed=3, n=2000)
    longs = [r for r in reqs if r.tags["class"] == "long"]
    assert abs(len(longs) / len(reqs) - 0.25) < 0.03
    assert all(400 <= r.tags["target_tokens"] <= 800 for r in longs)
    assert all(20 <= r.tags["target_tokens"] <= 100 for r in reqs if r.tags["class"] == "short")
    assert all(abs(r.prompt_tokens - r.tags["target_tokens"]) <= 2 for r in reqs)


def test_agent_sessions_grow_and_share_prefixes(text):
    p = WorkloadParams(**{**SMALL.__dict__, "agent_turns": 5, "agent_parallel": 3})
    reqs = take("agent", p, text, seed=5, n=30)  # two groups of 3 sessions x 5 turns
    sessions: dict[str, list] = {}
    for r in reqs:
        sessions.setdefault(r.session, []).append(r)
    assert len(sessions) == 6
    systems = {s[0].messages[0]["content"] for s in sessions.values()}
    assert len(systems) == 1  # one system prompt shared by every session
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(5))
        for prev, cur in zip(turns, turns[1:]):
            assert cur.messages[:len(prev.messages)] == prev.messages  # the history is resent whole
            assert cur.prompt().startswith(prev.prompt())
            assert cur.prompt_tokens > prev.prompt_tokens
    first = [s[0].prompt() for s in sessions.values()]
    assert len(set(first)) == len(first)  # different tasks


def test_needle_is_hidden_once_and_checkable(text):
    reqs = take("needle", SMALL, text, seed=11, n=20)
    for r in reqs:
        content = r.messages[-1]["content"]
        assert r.expect.isdigit() and len(r.expect) == 7
        assert content.count(r.expect) == 1
        assert content.rstrip().endswith("Answer with the number only.")
        assert 200 <= r.tags["target_tokens"] <= 2000
    depths = [r.tags["depth"] for r in reqs]
    assert min(depths) < 0.3 and max(depths) > 0.7


def test_rag_shares_the_system_prompt_and_reuses_passages(text):
    reqs = take("rag", SMALL, text, seed=2, n=50)
    assert len({r.messages[0]["content"] for r in reqs}) == 1
    used = [j for r in reqs for j in r.tags["passages"]]
    assert len(set(used)) < len(used)  # passages recur across requests
    assert all(len(set(r.tags["passages"])) == SMALL.rag_passages for r in reqs)
    approx = SMALL.rag_system_tokens + SMALL.rag_passages * SMALL.rag_passage_tokens
    assert all(0.9 * approx <= r.prompt_tokens <= 1.3 * approx for r in reqs)


def test_trace_is_read_with_aliases_and_scaled(tmp_path, text):
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(d) for d in [
        {"timestamp": 100.0, "prompt_tokens": 50, "output_tokens": 3},
        {"ts": 102.0, "prompt": "hello there"},
        {"timestamp": 101.0, "input_length": 80, "output_length": 5},
    ]) + "\n")
    reqs = list(wl.make("trace", WorkloadParams(trace=str(f), trace_speedup=2.0), text, 0))
    assert [r.at_s for r in reqs] == [0.0, 0.5, 1.0]  # sorted by time, relative, divided by the speedup
    assert [r.max_tokens for r in reqs] == [3, 5, None]
    assert reqs[2].messages[0]["content"] == "hello there"
    assert abs(reqs[0].prompt_tokens - 50) <= 2 and abs(reqs[1].prompt_tokens - 80) <= 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_tokens": 5}\n')
    with pytest.raises(ValueError, match="timestamp"):
        wl.read_trace(str(bad))


def test_exact_lengths_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from loadtest.text import _VOCAB

    pre = pre_tokenizers.Whitespace()
    pieces = [w for w, _ in pre.pre_tokenize_str(" ".join(_VOCAB).lower() + " . ? :")]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(["[UNK]"] + pieces))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    text = TextSource("words", tokenizer=str(tmp_path))
    import random

    for n in (1, 17, 300):
        assert text.count(text.passage(n, random.Random(n))) == n

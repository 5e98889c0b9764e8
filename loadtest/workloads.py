"""The workloads: reproducible request streams shaped like a prefill tier's traffic.

Each workload is an iterator of ``Request`` made from a seed alone (same seed, same requests, on a
machine with the same text source). Every request is a list of chat messages; completions requests
send their contents joined by blank lines (no chat template), so shared prefixes stay shared.

- ``rag``: one system prompt shared by every request + k passages drawn uniformly from a fixed pool
  (so passages recur across requests, as retrieved documents do) + a question.
- ``longdoc``: one long document (log-uniform length in [min, max], 8K-128K tokens by default; up
  to 1M with ``allow_huge``) + a question about it.
- ``needle``: filler text with one fact hidden at a random depth; the question asks for it and the
  answer is checked in the response (``Request.expect``).
- ``agent``: multi-turn sessions: a system prompt shared by all sessions, then each turn resends the
  whole history plus a tool result, so a session's prompts grow and each extends the previous one.
  Turns of one session are sent in order (the runner waits for turn t-1 before sending turn t).
  The assistant turns in the history are generated text, not the model's answers, so the prompts
  do not depend on the server.
- ``mix``: short and long prompts, a share ``long_share`` of them long.
- ``trace``: a JSONL file, one request a line: ``{"timestamp": s, "prompt_tokens": n}`` or
  ``{"timestamp": s, "prompt": "text"}``, optional ``"output_tokens": n``; sent at its timestamp
  (relative to the first line's, divided by ``trace_speedup``).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import random
from dataclasses import dataclass, field
from typing import Iterator

from loadtest.text import TextSource

WORKLOADS = ("rag", "longdoc", "needle", "agent", "mix", "trace")
LONGDOC_CAP = 131072  # 128K; allow_huge raises it to HUGE_CAP
HUGE_CAP = 1 << 20  # 1M tokens
_VAULTS = ("amber", "basalt", "cobalt", "delta", "ember", "falcon", "granite", "harbor", "indigo", "juniper",
           "kestrel", "lantern", "meridian", "nimbus", "obsidian", "pioneer", "quartz", "raven", "sierra",
           "tundra", "umber", "violet", "willow", "zephyr")


@dataclass
class Request:
    index: int
    workload: str
    messages: list[dict]
    prompt_tokens: int  # approximate, as the TextSource counts
    max_tokens: int | None = None  # None: the run's --max-tokens
    at_s: float | None = None  # trace: send at this offset from the start
    session: str | None = None  # agent: turns of one session are sent in order
    turn: int | None = None
    expect: str | None = None  # needle: the answer must contain this
    tags: dict = field(default_factory=dict)

    def prompt(self) -> str:
        """The completions prompt: the messages' contents joined by blank lines."""
        return "\n\n".join(m["content"] for m in self.messages)

    def describe(self) -> dict:
        """What the JSON keeps of a request (not its text)."""
        d = {"index": self.index, "workload": self.workload, "prompt_tokens_approx": self.prompt_tokens,
             "max_tokens": self.max_tokens}
        for k in ("at_s", "session", "turn", "expect"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return {**d, **self.tags}


@dataclass
class WorkloadParams:
    """Every workload's knobs (the CLI's ``--rag-*``, ``--doc-*``, ... options)."""

    # rag
    rag_system_tokens: int = 600
    rag_passages: int = 4
    rag_passage_tokens: int = 350
    rag_pool: int = 64
    # longdoc / needle
    doc_min_tokens: int = 8192
    doc_max_tokens: int = 131072
    allow_huge: bool = False
    # agent
    agent_system_tokens: int = 1200
    agent_first_tokens: int = 300
    agent_turn_tokens: int = 400
    agent_reply_tokens: int = 60
    agent_turns: int = 6
    agent_parallel: int = 4
    # mix
    short_min_tokens: int = 64
    short_max_tokens: int = 512
    long_min_tokens: int = 4096
    long_max_tokens: int = 32768
    long_share: float = 0.2
    # trace
    trace: str | None = None
    trace_speedup: float = 1.0

    def check(self, workload: str) -> None:
        cap = HUGE_CAP if self.allow_huge else LONGDOC_CAP
        if workload in ("longdoc", "needle"):
            if not 1 <= self.doc_min_tokens <= self.doc_max_tokens:
                raise ValueError("need 1 <= --doc-min-tokens <= --doc-max-tokens")
            if self.doc_max_tokens > cap:
                raise ValueError(f"--doc-max-tokens {self.doc_max_tokens} is over {cap}"
                                 + ("" if self.allow_huge else "; --allow-huge allows up to 1M (1048576)"))
        if workload == "mix":
            if not (1 <= self.short_min_tokens <= self.short_max_tokens and
                    1 <= self.long_min_tokens <= self.long_max_tokens):
                raise ValueError("need min <= max for --short-*-tokens and --long-*-tokens")
            if not 0.0 <= self.long_share <= 1.0:
                raise ValueError("--long-share must be within [0, 1]")
        if workload == "agent" and (self.agent_turns < 1 or self.agent_parallel < 1):
            raise ValueError("--agent-turns and --agent-parallel must be >= 1")
        if workload == "rag" and not 1 <= self.rag_passages <= self.rag_pool:
            raise ValueError("need 1 <= --rag-passages <= --rag-pool")
        if workload == "trace" and not self.trace:
            raise ValueError("the trace workload needs --trace FILE.jsonl")
        if self.trace_speedup <= 0:
            raise ValueError("--trace-speedup must be > 0")


def make(workload: str, params: WorkloadParams, text: TextSource, seed: int) -> Iterator[Request]:
    """The request stream of ``workload`` (infinite, except ``trace``)."""
    params.check(workload)
    gen = {"rag": _rag, "longdoc": _longdoc, "needle": _needle, "agent": _agent, "mix": _mix,
           "trace": _trace}.get(workload)
    if gen is None:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    return gen(params, text, seed)


def take(workload: str, params: WorkloadParams, text: TextSource, seed: int, n: int) -> list[Request]:
    return list(itertools.islice(make(workload, params, text, seed), n))


def _rng(*key) -> random.Random:
    return random.Random(":".join(map(str, key)))  # str seeds hash deterministically (sha512)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return lo if lo == hi else int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _question(text: TextSource, rng: random.Random) -> str:
    return "Question: " + text.sentence(rng, rng.randint(8, 14))[:-1] + "?"


def _req(index, workload, messages, text: TextSource, **kw) -> Request:
    tokens = sum(text.count(m["content"]) for m in messages)
    return Request(index, workload, messages, tokens, **kw)


# ---- the workloads ----
def _rag(p: WorkloadParams, text: TextSource, seed: int) -> Iterator[Request]:
    system = ("You are a helpful assistant. Answer the question from the passages below, citing them "
              "by number. Reference material follows. " + text.passage(p.rag_system_tokens, _rng("rag-system", seed)))
    pool: dict[int, str] = {}
    rng = _rng("rag", seed)
    for i in itertools.count():
        picks = rng.sample(range(p.rag_pool), p.rag_passages)
        for j in picks:
            if j not in pool:
                pool[j] = text.passage(p.rag_passage_tokens, _rng("rag-passage", seed, j))
        user = "\n".join(f"[{n + 1}] {pool[j]}" for n, j in enumerate(picks)) + "\n\n" + _question(text, rng)
        yield _req(i, "rag", [{"role": "system", "content": system}, {"role": "user", "content": user}], text,
                   tags={"passages": picks})


def _longdoc(p: WorkloadParams, text: TextSource, seed: int) -> Iterator[Request]:
    rng = _rng("longdoc", seed)
    for i in itertools.count():
        n = _log_uniform(rng, p.doc_min_tokens, p.doc_max_tokens)
        q = _question(text, rng)
        doc = text.passage(max(1, n - text.count(q) - 4), _rng("longdoc-doc", seed, i))
        yield _req(i, "longdoc", [{"role": "user", "content": f"Document:\n{doc}\n\n{q}"}], text,
                   tags={"target_tokens": n})


def _needle(p: WorkloadParams, text: TextSource, seed: int) -> Iterator[Request]:
    rng = _rng("needle", seed)
    for i in itertools.count():
        n = _log_uniform(rng, p.doc_min_tokens, p.doc_max_tokens)
        depth = rng.random()
        key, code = rng.choice(_VAULTS), str(rng.randrange(1_000_000, 10_000_000))
        fact = f" The secret number of the {key} vault is {code}. "
        question = (f"\n\nWhat is the secret number of the {key} vault? Answer with the number only.")
        filler = text.passage(max(1, n - text.count(fact + question)), _rng("needle-filler", seed, i))
        cut = int(len(filler) * depth)
        space = filler.find(" ", cut)
        cut = space if space >= 0 else len(filler)
        content = filler[:cut] + fact + filler[cut:].lstrip() + question
        yield _req(i, "needle", [{"role": "user", "content": content}], text, expect=code,
                   tags={"target_tokens": n, "depth": round(depth, 4)})


def _agent(p: WorkloadParams, text: TextSource, seed: int) -> Iterator[Request]:
    system = ("You are an agent with tools: search(query), read(url), run(code). Think, call a tool, read its "
              "result, repeat. Tool documentation follows. " + text.passage(p.agent_system_tokens,
                                                                           _rng("agent-system", seed)))
    index = itertools.count()
    for group in itertools.count():
        histories = {}
        for turn in range(p.agent_turns):
            for k in range(p.agent_parallel):
                s = group * p.agent_parallel + k
                rng = _rng("agent-session", seed, s, turn)
                if turn == 0:
                    histories[s] = [{"role": "system", "content": system},
                                    {"role": "user", "content": "Task: " + text.passage(p.agent_first_tokens, rng)}]
                else:
                    histories[s] = histories[s] + [
                        {"role": "assistant", "content": text.passage(p.agent_reply_tokens, rng)},
                        {"role": "user", "content": "Tool result: " + text.passage(p.agent_turn_tokens, rng)}]
                yield _req(next(index), "agent", [dict(m) for m in histories[s]], text,
                           session=f"s{s}", turn=turn)


def _mix(p: WorkloadParams, text: TextSource, seed: int) -> Iterator[Request]:
    rng = _rng("mix", seed)
    for i in itertools.count():
        long = rng.random() < p.long_share
        n = rng.randint(p.long_min_tokens, p.long_max_tokens) if long else rng.randint(p.short_min_tokens,
                                                                                       p.short_max_tokens)
        body = text.passage(n, _rng("mix-text", seed, i))
        yield _req(i, "mix", [{"role": "user", "content": body}], text,
                   tags={"class": "long" if long else "short", "target_tokens": n})


def read_trace(path: str) -> list[dict]:
    """The trace's lines as dicts with ``at_s`` (relative, unscaled), ``prompt_tokens`` or ``prompt``,
    ``output_tokens``; sorted by time. Accepts common aliases of the field names."""
    rows = []
    for no, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{no}: not JSON ({e})") from None
        ts = _first(d, "timestamp", "ts", "time", "arrival_time")
        prompt = _first(d, "prompt", "text")
        n = _first(d, "prompt_tokens", "input_tokens", "input_length", "prompt_len")
        out = _first(d, "output_tokens", "output_length", "max_tokens")
        if ts is None or (prompt is None and n is None):
            raise ValueError(f"{path}:{no}: each line needs a timestamp and prompt_tokens or prompt")
        rows.append({"ts": float(ts), "prompt": prompt, "prompt_tokens": None if n is None else int(n),
                     "output_tokens": None if out is None else int(out), "line": no})
    rows.sort(key=lambda r: r["ts"])  # stable: equal timestamps keep file order
    t0 = rows[0]["ts"] if rows else 0.0
    for r in rows:
        r["at_s"] = r["ts"] - t0
    return rows


def _first(d: dict, *keys):
    return next((d[k] for k in keys if d.get(k) is not None), None)


def _trace(p: WorkloadParams, text: TextSource, seed: int) -> Iterator[Request]:
    for i, r in enumerate(read_trace(p.trace)):
        content = r["prompt"] if r["prompt"] is not None else text.passage(r["prompt_tokens"],
                                                                            _rng("trace", seed, i))
        yield _req(i, "trace", [{"role": "user", "content": content}], text, max_tokens=r["output_tokens"],
                   at_s=r["at_s"] / p.trace_speedup, tags={"trace_line": r["line"]})


def params_from(ns) -> WorkloadParams:
    """WorkloadParams from an argparse namespace (attributes of the same names)."""
    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(WorkloadParams) if hasattr(ns, f.name)}
    return WorkloadParams(**kw)

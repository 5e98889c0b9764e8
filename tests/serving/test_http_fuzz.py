"""Malformed requests at the OpenAI gateway, over real HTTP, against the real engine (SmolLM2 in
transfer mode 'local', as in test_http.py): each gets a 4xx whose OpenAI-style error says what to
change (never a 5xx, never a hang), the server keeps serving, and the pool drains to zero blocks.

Each request is a valid body with one to three mutations. A mutation either breaks the request (it
carries a word its error message must contain when it is the only breaking one) or is passed through
(a field the gateway leaves to a decode, such as ``user`` or ``best_of``: the answer is then 200).
Seeded (hypothesis, derandomized), a few hundred requests, about 20 s on 2 CPU cores."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefill_server.serving.http import create_app
from prefill_server.serving.server import bind

VOCAB, CONTEXT, POOL_TOKENS = 49152, 8192, 64 * 16  # SmolLM2-135M; conftest's pool of 64 blocks of 16
TIMEOUT_S = 30.0  # per request: a valid one takes well under a second here


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


# ---- building bodies json.dumps cannot write ----

class Raw(str):
    """JSON text spliced into the body as is: NaN, 1e400, lone surrogate escapes, deep nesting."""


class Bytes(bytes):
    """Bytes spliced into the body as is: invalid UTF-8."""


DELETE = object()  # a mutation that removes the field


def to_json(x) -> bytes:
    if isinstance(x, Bytes):
        return bytes(x)
    if isinstance(x, Raw):
        return str(x).encode()
    if isinstance(x, dict):
        return b"{" + b",".join(to_json(str(k)) + b":" + to_json(v) for k, v in x.items()) + b"}"
    if isinstance(x, list):
        return b"[" + b",".join(to_json(v) for v in x) + b"]"
    return json.dumps(x, ensure_ascii=False).encode()


def nested(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


BAD_UTF8 = [Bytes(b'"\xff"'), Bytes(b'"a\xc3\x28b"'), Bytes(b'"\xc0\xaf"'), Bytes(b'"\xf8\x88\x80\x80\x80"'),
            Bytes(b'"ok\x80"')]
# lone surrogates: escaped, or encoded as UTF-8 would encode them (Python's json decodes those too)
SURROGATES = [Raw('"\\ud800"'), Raw('"a\\udc00b"'), Raw('"\\ude00\\ud83d"'), Raw('"\\udbff"'),
              Bytes(b'"\xed\xa0\x80"'), Bytes(b'"x\xed\xbf\xbf"')]
NON_FINITE = [(Raw("NaN"), "NaN"), (Raw("Infinity"), "Infinity"), (Raw("-Infinity"), "Infinity"),
              (Raw("1e400"), "range"), (Raw("-1e999"), "range")]
JSON_LEVEL = ([(v, "surrogate") for v in SURROGATES] + [(v, "JSON") for v in BAD_UTF8] + NON_FINITE
              + [(Raw("9" * 5000), "too long"), (Raw("-" + "1" * 4301), "too long"), (nested(50_000), "nested"),
                 (Raw('{"a":' * 30_000 + "1" + "}" * 30_000), "nested")])

# ---- mutations: (field, value, needle); needle None = passed through to the decode ----


def typed(field: str, values) -> list[tuple]:
    return [(field, v, field) for v in values]


COMMON = (
    typed("model", [5, 1.5, True, [], {}, ["m"]])
    + [("model", v, "not served") for v in ("no-such-model", "x" * 5000, "SmolLM2", " ")]
    + [("model", v, None) for v in (None, "")]  # (the served model, as vLLM takes them)
    # values vLLM's request classes read leniently ("3" is 3, 1 is true) pass; others are refused, named
    + typed("stream", [[], {}, "maybe", 2]) + [("stream", v, None) for v in (True, False, "true", 1, 0, None, "no")]
    + typed("max_tokens", ["ten", 1.5, 0, -1, -10**30, [1], {}])
    + [("max_tokens", v, None) for v in (None, 1, 16, "3", 2.0, True)] + [("max_tokens", 10**30, "context")]
    + typed("temperature", [-0.5, -1e-300, -10**30, [0.5], {}, "hot"])
    + [("temperature", v, None) for v in (None, 0, 0.0, 1e-300, 0.7, 2, "0.5", True, False)]
    + typed("temperature", [2.0001, 1e300])
    + typed("top_p", [0, 0.0, -0.1, 1.0000001, 2, 10**30, False, [], {}])
    + [("top_p", v, None) for v in (None, 5e-324, 0.5, 1, 1.0, "1")]
    + typed("top_k", [-2, -10**30, 1.5, [], {}]) + [("top_k", v, None) for v in (-1, 0, 1, 5, 10**30, "5", True)]
    + typed("seed", [10**30, -10**30, 2**63, -2**63 - 1, 1.5, [], {}])
    + [("seed", v, None) for v in (None, 0, -1, 2**63 - 1, -2**63, "1", True)]
    + typed("n", [0, 2, -1, 10**30, []]) + [("n", v, None) for v in (1, "1", 1.0, True)]
    # JSON that Python parses but is not JSON (or not text), in any field, known or not
    + [(f, v, needle) for f in ("temperature", "max_tokens", "stop", "user", "extra") for v, needle in JSON_LEVEL]
    # sampling fields checked as the decode checks them (``test_sampling_checks.py``)
    + typed("stop", [5, -10**30, [1, "a", None], {"a": {"b": []}}, nested(100), "", ["a", ""]])
    + [("stop", v, None) for v in ("x" * 20000, None, "🙂\u2028", ["a", "b"], [])]
    + typed("presence_penalty", [5, -10**30, "x", [1], {}, nested(100), 2.5])
    + [("presence_penalty", v, None) for v in (None, -2, 1.5)]
    + typed("stream_options", [5, "x" * 20000, [1, "a", None], nested(100)]) + [("stream_options", None, None)]
    # fields vLLM 0.32 does not have (ignored): any JSON passes here
    + [(f, v, None) for f in ("best_of", "logits_processors", "", "\u0000", "x" * 300, "🙂")
       for v in (5, -10**30, "x" * 20000, [1, "a", None], {"a": {"b": []}}, nested(100), None, "🙂\u2028")]
    + typed("user", [5, -10**30, [1, "a", None], {"a": {"b": []}}, nested(100)])
    + [("user", v, None) for v in ("x" * 20000, None, "🙂\u2028")]
    + typed("response_format", [5, "x", [1], {"a": {"b": []}}, {"type": "xml"}, {"type": "json_object"},
                                {"type": "json_schema"}])
    + [("response_format", v, None) for v in (None, {"type": "text"})]
    + typed("stop_token_ids", [5, "x", {"a": 1}, [1.5], [None], nested(50)])
    + [("stop_token_ids", v, None) for v in (None, [], [1, 2], ["5"])]  # (vLLM's request class reads "5" as 5)
    + [(f, v, "vocabulary") for f in ("stop_token_ids", "allowed_token_ids") for v in ([VOCAB], [-1], [3, 10**30])]
    + typed("allowed_token_ids", [[], 5, "x", [1.5], [None], nested(50)]) + [("allowed_token_ids", [7, 8], None)]
    + [("logit_bias", v, "vocabulary") for v in ({str(VOCAB): 1}, {"-1": 2})]
    + [("logit_bias", v, None) for v in ({"7": 1e30}, {"7": "-2.5"}, {})]
    # malformed, or (echo) what the first token alone (transfer mode local) cannot apply: refused, named
    + [(f, v, f if v is not None else None) for f in ("echo", "logit_bias")
       for v in (5, -10**30, "x" * 20000, [1, "a", None], {"a": {"b": []}}, nested(100), None, "🙂\u2028")]
)

PROMPT = (
    [("prompt", DELETE, "prompt")]
    + typed("prompt", [None, 42, 1.5, True, {}, {"text": "x"}, [1, "a"], [1.5], [True], [None], [[["x"]]],
                       [["a"]], [[1], "a"], [{"a": 1}], nested(50)])
    + [("prompt", v, "empty") for v in ("", [], [[]], [""])]
    + [("prompt", v, "one prompt") for v in (["a", "b"], [[1], [2]], ["a"] * 100)]
    + [("prompt", v, "vocabulary") for v in ([-1], [1, VOCAB], [10**30], [-10**30], [5, 2**63, 7], [VOCAB + 1] * 3)]
    + [("prompt", v, "context") for v in ([1] * (CONTEXT + 1), [[2] * 9000], "word " * 9000, "x" * 100_000)]
    + [("prompt", v, "shorter prompt") for v in ([1] * (POOL_TOKENS + 1), [[3] * 5000], "hi " * 3000)]
    + typed("suffix", [5, "x", [1]]) + [("suffix", None, None)] + typed("n", [None])  # (a chat's may be null)
    + typed("logprobs", [-2, -10**30, "x", "2", [1], {}]) + [("logprobs", v, None) for v in (None, 0, 5, True)]
    + [("logprobs", v, "logprobs") for v in (-1, 21)]  # (the whole vocabulary: past vLLM's default 20)
    + [("prompt", v, "surrogate") for v in SURROGATES]
    + [("prompt", v, "JSON") for v in BAD_UTF8]
    + [("prompt", v, None) for v in ("🙂 ok", "\u0000", Raw('"\\ud83d\\ude00"'), [0], [VOCAB - 1], ["hello"],
                                     [[1, 2, 3]])]  # (a surrogate pair is fine)
)

ROLES = ["system", "user", "assistant", "tool", "developer"]
CHAT = (
    [("messages", DELETE, "messages")]
    + typed("messages", [None, "hi", 5, {}, {"role": "user", "content": "x"}, [], [5], [None], ["hi"],
                         [[{"role": "user", "content": "x"}]], nested(40)])
    + [("message", {"content": "x"}, "role")]
    + [("message", {"role": r, "content": "x"}, "role") for r in (5, None, [], {"name": "user"}, True)]
    + [("message", {"role": r, "content": "x"}, None) for r in ("wizard", "USER", "", "user ", "function")]
    + [("message", {"role": r, "content": None}, "content") for r in ("user", "system", "tool", "developer")]
    + [("message", {"role": "user", "content": c}, "content") for c in
       (5, 1.5, True, {"a": 1}, [5], ["text"], [[]], [{"type": "text", "text": 5}], [{"type": "text"}],
        [{"text": "x"}], [{"type": "image_url", "image_url": {"url": "http://x"}}])]
    + [("message", {"role": "user", "content": c}, "surrogate") for c in SURROGATES]
    + [("message", {"role": "user", "content": c}, "JSON") for c in BAD_UTF8]
    + [("message", {"role": "user", "content": "word " * 9000}, "context"),
       ("message", {"role": "user", "content": "hi " * 3000}, "shorter prompt"),
       ("message", {"role": "user", "content": Raw("NaN")}, "NaN")]
    + [("message", m, None) for m in ({"role": "assistant", "content": None}, {"role": "tool", "content": []},
                                      {"role": "user", "content": [{"type": "text", "text": "a"}]},
                                      {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                                      {"role": "user", "content": "x", "name": 5, "tool_calls": "x"},
                                      {"role": "developer", "content": "🙂"}, {"role": "system"})]
    + typed("logprobs", [5, "x", [], {}]) + [("logprobs", v, None) for v in (None, True, False, 0, "yes")]
    + typed("max_completion_tokens", [0, -1, 1.5, []])
    + [("max_completion_tokens", v, None) for v in (None, 1, "5", True)]
    + [("max_completion_tokens", 10**30, "context")]
    + typed("tools", [5, "x", {"a": 1}, [5], [None], ["f"], [[]], True, []])
    + [("tools", v, None) for v in (None, [{"type": "function", "function": {"name": "f", "parameters": {}}}])]
    + typed("tools", [[{"a": 1}], [{"function": {"name": 5}}]])
    + typed("tool_choice", ["auto", "x", 5, {"function": {"name": "f"}}])
    + [("tool_choice", v, None) for v in (None, "none")] + [("n", None, None)]
)


def valid_completion() -> st.SearchStrategy[dict]:
    prompt = st.one_of(st.sampled_from(["The capital of France is", "Hello", "1 2 3", "¿Qué?", "  x  "]),
                       st.text(min_size=1, max_size=30),
                       st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
                       st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8).map(lambda t: [t]),
                       st.text(min_size=1, max_size=20).map(lambda t: [t]))
    return st.fixed_dictionaries({"prompt": prompt}, optional=SAMPLING)


def valid_chat() -> st.SearchStrategy[dict]:
    message = st.fixed_dictionaries({"role": st.sampled_from(ROLES),
                                     "content": st.text(max_size=30) | st.sampled_from(["Hi!", "Name a colour."])})
    return st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}, optional=SAMPLING)


SAMPLING = {"model": st.none(), "stream": st.booleans(), "max_tokens": st.integers(1, 64),
            "temperature": st.sampled_from([0, 0.0, 0.7, 1.0]), "top_p": st.sampled_from([0.5, 1.0]),
            "top_k": st.sampled_from([-1, 5]), "seed": st.sampled_from([0, 7, 2**63 - 1, -2**63]),
            "n": st.just(1)}


@st.composite
def cases(draw, base: st.SearchStrategy[dict], own: list[tuple]):
    """(body bytes, needles of the breaking mutations, the mutations) of one request."""
    body = draw(base)
    breaking = [m for m in own + COMMON if m[2] is not None]
    passing = [m for m in own + COMMON if m[2] is None]
    muts = draw(st.lists(st.sampled_from(breaking) | st.sampled_from(breaking) | st.sampled_from(passing),
                         min_size=1, max_size=3))  # about 1 in 5 requests passes
    final = {}
    for field, value, needle in muts:
        if field == "message":  # one message of the list replaced or added
            msgs = body.get("messages")
            if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict):
                i = draw(st.integers(0, len(msgs)))
                body["messages"] = msgs[:i] + [value] + msgs[i + 1:]
                final[("message", i)] = needle
            continue  # (no list to put it in: "messages" itself is already wrong)
        final[field] = needle
        if value is DELETE:
            body.pop(field, None)
        else:
            body[field] = value
    needles = [n for n in final.values() if n is not None]
    return to_json(body), needles, muts


# ---- the server: the app of test_http.py over real HTTP, so that every request has a timeout ----

@pytest.fixture(scope="module")
def server(local_service):
    info, pool = local_service.info, local_service.worker.engine.pool
    assert (info.vocab_size, info.max_model_len, pool.num_blocks * pool.block_size) == (VOCAB, CONTEXT, POOL_TOKENS)
    sock = bind("127.0.0.1", 0)
    srv = uvicorn.Server(uvicorn.Config(create_app(local_service, None), log_level="warning", access_log=False))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", srv
    srv.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=TIMEOUT_S) as c:
        yield c


def send(http, method: str, path: str, raw: bytes | None = None, ctype: str | None = "application/json",
         **kw) -> httpx.Response:
    headers = {"content-type": ctype} if ctype is not None and raw is not None else {}
    try:
        return http.request(method, path, content=raw, headers=headers, **kw)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {TIMEOUT_S:.0f} s: {method} {path} {raw[:300] if raw else b''!r}")


def check_error(r: httpx.Response, what) -> str:
    """A 4xx with an OpenAI error object; returns its message."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500], what)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and len(err["message"].strip()) > 10, (err, what)
    assert isinstance(err["type"], str) and err["type"] and err["code"] == r.status_code, (err, what)
    return err["message"]


def check_answer(r: httpx.Response, path: str, what) -> None:
    """The first token alone: a whole answer, or (``"stream": true``) its server-sent events."""
    assert r.status_code == 200, (r.status_code, r.text[:500], what)
    if r.headers["content-type"].startswith("text/event-stream"):
        data = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert data[-1] == "[DONE]", (data, what)
        events = [json.loads(d) for d in data[:-1]]
        ends = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
        assert len(ends) == 1, (events, what)
        choice = ends[0]
        assert isinstance(choice["delta"]["content"] if path.endswith("chat/completions") else choice["text"], str)
        return
    out = r.json()
    assert out["usage"]["prompt_tokens"] >= 1 and out["usage"]["completion_tokens"] == 1, out
    choice = out["choices"][0]
    assert isinstance(choice["message"]["content"] if path.endswith("chat/completions") else choice["text"], str)


def check_case(http, pool, path: str, raw: bytes, needles: list[str], what) -> None:
    r = send(http, "POST", path, raw)
    if needles:
        message = check_error(r, what)
        if len(needles) == 1:  # the one thing wrong: the message names it
            assert needles[0].lower() in message.lower(), (needles[0], message, what)
    else:
        check_answer(r, path, what)
    assert pool.num_used == 0, what


# ---- the fuzz ----

@fuzz_settings(400)
@given(case=cases(valid_completion(), PROMPT))
def test_completions_fuzz(http, local_service, case):
    raw, needles, muts = case
    check_case(http, local_service.worker.engine.pool, "/v1/completions", raw, needles, (raw[:300], muts))


@fuzz_settings(300)
@given(case=cases(valid_chat(), CHAT))
def test_chat_fuzz(http, local_service, case):
    raw, needles, muts = case
    check_case(http, local_service.worker.engine.pool, "/v1/chat/completions", raw, needles, (raw[:300], muts))


GOOD = b'{"prompt": "Hello", "max_tokens": 1}'
TOP_LEVEL = st.one_of(
    st.binary(max_size=64).map(lambda b: (b, "")),  # hardly ever JSON; a JSON object lacks prompt/messages
    st.sampled_from([b"", b" ", b"null", b"true", b"0", b"-1.5e3", b'"prompt"', b"[]", b"[" + GOOD + b"]",
                     b"[[]]", b'"{\\"prompt\\": \\"x\\"}"']).map(lambda b: (b, "")),
    st.sampled_from([b"{", b"}", b"{prompt: 'x'}", b"{'prompt': 'x'}", b'{"prompt": "x",}', b'{"prompt" "x"}',
                     GOOD + b"x", GOOD + GOOD, b"\xef\xbb\xbf\xef\xbb\xbf" + GOOD, b"\x00" + GOOD,
                     b'{"prompt": "x"\x00}', b'{"prompt": "a\nb"}', b'{"prompt": "\\x41"}']).map(lambda b: (b, "JSON")),
    st.integers(1, len(GOOD) - 1).map(lambda n: (GOOD[:n], "JSON")),  # a truncated body
    st.integers(1, 128).map(lambda d: (to_json(nested(d)), "JSON object")),
    st.integers(129, 200_000).map(lambda d: (to_json(nested(d)), "nested")),
    st.sampled_from(BAD_UTF8).map(lambda b: (b"{" + bytes(b) + b": 1}", "JSON")),
    st.sampled_from([b"\xff" + GOOD, GOOD[:-1] + b"\xc3}"]).map(lambda b: (b, "JSON")),
    st.just((GOOD.replace(b"Hello", b"\xed\xa0\x80"), "surrogate")),
    st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                     "application/xml", "text/json", "application/jsonx", "*/*", "json", "application/octet-stream",
                     "text/html; charset=utf-8"]).map(lambda ct: (GOOD, "Content-Type", ct)),
)


@fuzz_settings(250)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), case=TOP_LEVEL)
def test_malformed_bodies_fuzz(http, local_service, path, case):
    raw, needle, ctype = (*case, "application/json")[:3]
    r = send(http, "POST", path, raw, ctype)
    message = check_error(r, (path, raw[:300], ctype))
    assert needle.lower() in message.lower(), (needle, message, raw[:300])
    assert local_service.worker.engine.pool.num_used == 0


GETS = {"/health", "/v1/models", "/metrics"}
POSTS = {"/v1/completions", "/v1/chat/completions"}
QUERY = st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3)
OTHER_PATHS = st.one_of(st.just("/"), st.from_regex(r"(/[A-Za-z0-9_~-]{1,12}){1,4}/?", fullmatch=True).filter(
    lambda p: p.rstrip("/") not in GETS | POSTS))  # (the real paths with a "/" redirect to them)


@fuzz_settings(100)
@given(case=st.one_of(
    st.tuples(st.just("GET"), st.sampled_from(sorted(GETS)), QUERY),  # extra parameters are ignored
    st.tuples(st.sampled_from(["POST", "PUT", "DELETE", "PATCH", "OPTIONS"]), st.sampled_from(sorted(GETS)), QUERY),
    st.tuples(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"]), st.sampled_from(sorted(POSTS)), QUERY),
    st.tuples(st.sampled_from(["GET", "POST"]), OTHER_PATHS, QUERY)))
def test_other_endpoints_fuzz(http, local_service, case):
    method, path, query = case
    r = send(http, method, path, b"{}" if method in ("POST", "PUT", "PATCH") else None, params=query)
    if method == "GET" and path in GETS:
        assert r.status_code == 200, (path, query, r.text[:300])
        if path == "/health":
            assert r.json() == {"status": "ok"}
        elif path == "/v1/models":
            assert r.json()["data"][0]["id"] == local_service.info.served_name
        else:
            assert "prefill_server:kv_blocks_in_use" in r.text
        return
    message = check_error(r, case)
    if path in GETS | POSTS:
        assert r.status_code == 405 and ("use GET" if path in GETS else "use POST") in message, message
    else:
        assert r.status_code == 404 and "/v1/chat/completions" in message, message


def test_gateway_connections_do_not_wait_for_acks(http, server):
    """``serve``'s socket: its connections send each response at once (TCP_NODELAY). With Nagle, a
    response written in two parts (head, body) waited for the client's delayed ACK: ~40 ms each."""
    assert send(http, "GET", "/health").status_code == 200  # (a connection open now)
    conns = list(server[1].server_state.connections)
    assert conns and all(c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                         for c in conns)


def test_concurrent_good_and_bad(http, local_service):
    """Bad requests racing good ones in the same batches lose nothing and leak nothing."""
    bodies = [("/v1/completions", {"prompt": "Hello there", "temperature": 0}, 200),
              ("/v1/completions", {"prompt": [1] * (POOL_TOKENS + 1)}, 400),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}, 200),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
              ("/v1/completions", {"prompt": [VOCAB]}, 400),
              ("/v1/completions", {"prompt": [3, 4, 5], "temperature": 1.0, "top_k": 3, "seed": 1}, 200)] * 5
    with ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(lambda b: send(http, "POST", b[0], to_json(b[1])), bodies))
    for (path, body, status), r in zip(bodies, rs):
        assert r.status_code == status, (body, r.text[:300])
        if status == 200:
            check_answer(r, path, body)
        else:
            check_error(r, body)
    assert local_service.worker.engine.pool.num_used == 0


def test_still_serving_after_the_fuzzing(http, local_service):
    engine = local_service.worker.engine
    assert engine._thread.is_alive()
    assert engine.pool.num_used == 0 and engine.pool.num_leases == 0
    r = send(http, "POST", "/v1/completions", to_json({"prompt": "The capital of France is", "temperature": 0}))
    check_answer(r, "/v1/completions", "after")
    assert "Paris" in r.json()["choices"][0]["text"]
    for stream in (False, True):
        r = send(http, "POST", "/v1/chat/completions",
                 to_json({"messages": [{"role": "user", "content": "Hi!"}], "stream": stream, "temperature": 0}))
        check_answer(r, "/v1/chat/completions", "after")
    assert send(http, "GET", "/health").json() == {"status": "ok"}
    in_use = re.search(r"^prefill_server:kv_blocks_in_use (\S+)$", send(http, "GET", "/metrics").text, re.M)
    assert float(in_use.group(1)) == 0
    assert engine.pool.num_used == 0 and engine.pool.num_leases == 0

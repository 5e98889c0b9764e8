"""What a stranger's traffic does to the gateway, over real sockets: a client that hangs up cancels
its work and is never forwarded, a decode that dies mid-stream gives the client an error event,
oversized bodies get 413, a huge prompt never stalls the server, limits come from the decode, a
queue too long to start in time sheds at once with 429 and Retry-After.

The engine runs the tiny model of grpc_harness (slowed per forward where a test needs time); the
decode is tests/serving/fake_decode.py."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from fake_decode import FakeDecode
from grpc_harness import make_service
from prefill_server.engine.types import PrefillRequest
from prefill_server.errors import Overloaded, PoolExhausted
from prefill_server.serving.background import BackgroundServer
from prefill_server.serving.decode_client import DecodeClient
from prefill_server.serving.http import create_app

SLOW_PROMPT = "x" * 200  # 4 chunks of 64 tokens: 4 forwards


def counter(service, family: str, outcome: str) -> float:
    m = getattr(service.worker.engine.metrics, family)
    return m.labels(outcome)._value.get()


def wait_for(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture()
def stack():
    """(service, fake decode, gateway url): the engine, a decode and the HTTP gateway, running."""
    svc = make_service(num_blocks=64, max_queue_wait_s=30.0)
    svc.worker.engine.start()
    with FakeDecode() as decode, BackgroundServer(create_app(svc, DecodeClient(decode.url))) as gw:
        yield svc, decode, gw.url
    svc.worker.engine.stop()


def test_decode_counting_another_prompt_gets_502_not_its_answer(stack):
    """A decode that read the request as another number of prompt tokens answered from the KV of
    another prompt: the client gets 502 saying so, never that answer, and the KV is freed."""
    svc, decode, url = stack
    decode.miscount = 1
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 3}, timeout=30)
    assert r.status_code == 502, r.text
    assert "withheld" in r.json()["error"]["message"]
    assert wait_for(lambda: svc.worker.engine.pool.num_used == 0, 5.0)
    decode.miscount = 0
    assert httpx.post(url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 3},
                      timeout=30).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_that_stalls_past_the_lease_still_finds_its_kv(stream):
    """A decode that stalls past --lease-ttl without heartbeats (a frozen worker) must never read
    blocks freed meanwhile and handed to another request: while the gateway's call to it is open,
    the request's lease is held; once the call has ended it runs out as any lease does."""
    ttl = 0.6
    svc = make_service(num_blocks=64, max_queue_wait_s=30.0, lease_ttl_s=ttl)
    svc.worker.engine.start()
    pool = svc.worker.engine.pool
    try:
        with FakeDecode(delay_s=5 * ttl) as decode, BackgroundServer(create_app(svc, DecodeClient(decode.url))) as gw:
            answer = {}

            def call():
                answer["r"] = httpx.post(gw.url + "/v1/completions", timeout=30,
                                         json={"prompt": "hello there", "max_tokens": 3, "stream": stream})
            t = threading.Thread(target=call)
            t.start()
            assert wait_for(lambda: decode.requests, 10.0)
            time.sleep(3 * ttl)  # (expired leases are freed every 0.5 s)
            assert pool.num_leases == 1, "the lease ran out while its decode call was open"
            t.join(30)
            assert answer["r"].status_code == 200
            assert wait_for(lambda: pool.num_used == 0, 2 * ttl + 1.0), "the lease was held after the call"
    finally:
        svc.worker.engine.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_during_prefill_cancels_it_and_never_reaches_the_decode(stack, stream):
    svc, decode, url = stack
    svc.worker.engine.runner.model.delay_s = 0.4
    before = counter(svc, "requests", "cancelled"), counter(svc, "prefills", "RequestCancelled")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": SLOW_PROMPT, "max_tokens": 4, "stream": stream},
                   timeout=0.6)  # hangs up mid-prefill (4 forwards of 0.4 s)
    assert wait_for(lambda: counter(svc, "prefills", "RequestCancelled") == before[1] + 1, 5.0), \
        "the prefill ran on after its client had gone"
    assert wait_for(lambda: svc.worker.engine.pool.num_used == 0)
    assert counter(svc, "requests", "cancelled") == before[0] + 1
    assert counter(svc, "requests", "ok") == 0
    time.sleep(0.5)
    assert decode.requests == [], "a cancelled request was forwarded to the decode"


def test_client_gone_while_the_decode_answers_closes_the_decode_request(stack):
    svc, decode, url = stack
    decode.delay_s = 3.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=1.0)
    assert wait_for(lambda: decode.cancelled == 1, 5.0), "the decode kept working for a client that had gone"
    assert wait_for(lambda: svc.worker.engine.pool.num_used == 0)
    assert counter(svc, "requests", "cancelled") == 1


def test_decode_dying_mid_stream_gives_the_client_an_error(stack):
    """The official SDK ends a cut stream normally unless an error event says otherwise."""
    svc, decode, url = stack
    decode.tokens, decode.break_after = 5, 2
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    got = []
    with pytest.raises(openai.APIError, match="stream broke"):
        for chunk in client.completions.create(model="tiny", prompt="hello", max_tokens=5, stream=True):
            got.append(chunk.choices[0].text)
    assert got == [" ok", " ok"]
    assert wait_for(lambda: counter(svc, "requests", "DecodeStreamBroken") == 1)  # (counted as the stream ends)
    assert counter(svc, "requests", "ok") == 0
    decode.break_after = None  # the decode is back: whole streams again
    assert wait_for(lambda: httpx.get(url + "/health").status_code == 200)
    text = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="hi", max_tokens=5,
                                                                          stream=True))
    assert text == " ok" * 5 and wait_for(lambda: counter(svc, "requests", "ok") == 1)


def test_body_limit_and_huge_prompts_never_stall_the_server():
    svc = make_service(num_blocks=64)
    svc.worker.engine.start()
    app = create_app(svc, None, max_body_bytes=64 * 1024)
    try:
        with BackgroundServer(app) as gw:
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": "y" * 100_000})
            assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

            def chunks():  # no Content-Length: the limit applies while reading
                for _ in range(100):
                    yield b"y" * 1000
            r = httpx.post(gw.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413
            # under the limit but longer than any prompt of 256 tokens can be: refused before tokenizing
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": "y" * 60_000})
            assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        svc.worker.engine.stop()


def test_tokenizing_a_long_prompt_leaves_health_answering(local_service):
    """SmolLM2's tokenizer on ~2 MB of text takes seconds: off the event loop, /health answers."""
    with BackgroundServer(create_app(local_service, None)) as gw:
        text = "word " * 400_000
        result = {}
        t = threading.Thread(target=lambda: result.update(r=httpx.post(gw.url + "/v1/completions",
                                                                        json={"prompt": text}, timeout=120)))
        t.start()
        time.sleep(0.3)
        worst = 0.0
        while t.is_alive():
            t0 = time.monotonic()
            assert httpx.get(gw.url + "/health", timeout=30).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
        t.join()
        assert result["r"].status_code == 400 and "context" in result["r"].json()["error"]["message"]
        assert worst < 0.5, f"/health took {worst:.2f} s while a prompt was tokenized"


def test_prompt_and_answer_must_fit_the_context(stack):
    svc, decode, url = stack  # the tiny model's context: 256 tokens
    r = httpx.post(url + "/v1/completions", json={"prompt": [1] * 256})
    assert r.status_code == 400 and "no room" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [1] * 200, "max_tokens": 100})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "at most 56 tokens" in msg and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 200}],
                                                       "max_completion_tokens": 100})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert decode.requests == [] and svc.worker.engine.pool.num_used == 0


def test_a_queue_too_long_to_start_in_time_sheds_at_once_with_retry_after():
    svc = make_service(num_blocks=64, max_queue_wait_s=1.0)
    eng = svc.worker.engine
    eng.runner.model.delay_s = 0.3
    eng.start()
    try:
        eng.throughput.record(64, 2.0)  # measured: 32 tokens/s
        first = eng.submit(PrefillRequest("a", (1,) * 40))  # 40 tokens ahead: 1.25 s > 1 s
        with pytest.raises(Overloaded) as e:
            eng.submit(PrefillRequest("b", (1,) * 10))
        assert e.value.retry_after_s >= 1 and "tokens/s" in e.value.message
        assert e.value.http_status == 429
        first.result(timeout=30)
        eng.abort("a")
        app = create_app(svc, None)
        with BackgroundServer(app) as gw:
            eng.throughput.record(1, 1000.0)  # now ~0.06 tokens/s: anything queued sheds
            eng.submit(PrefillRequest("c", (1,) * 64))
            tokenized = []  # refused before tokenizing: no thread hop, no tokenizer time
            encode, encode_chat = svc.encode_prompt, svc.encode_chat
            svc.encode_prompt = lambda *a, **k: tokenized.append(a) or encode(*a, **k)
            svc.encode_chat = lambda *a, **k: tokenized.append(a) or encode_chat(*a, **k)
            r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x"})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            r = httpx.post(gw.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 429 and "queue is full" in r.json()["error"]["message"]
            assert tokenized == []
            eng.abort("c")
    finally:
        eng.stop()


def test_queue_deadline_names_compute_or_kv_blocks():
    svc = make_service(num_blocks=8, block_size=8, token_budget=8, max_queue_wait_s=0.3)
    eng = svc.worker.engine
    eng.runner.model.delay_s = 0.2
    eng.throughput.record(10**6, 1.0)  # a (wrong) fast estimate: admitted, then held up by compute
    eng.start()
    try:  # compute: a long prompt runs 8 steps of 0.2 s; the next waits past 0.3 s with the pool free
        long = eng.submit(PrefillRequest("long", (1,) * 32))
        with pytest.raises(Overloaded, match="for compute") as e:
            eng.submit(PrefillRequest("next", (1,) * 60)).result(timeout=30)
        assert e.value.http_status == 429
        eng.runner.model.delay_s = 0.0
        long.result(timeout=30)  # done and leased (its 4 blocks held): nothing left to compute, so a
        assert eng.pool.num_used == 4  # stall of this machine cannot make the next wait "for compute"
        with pytest.raises(PoolExhausted, match="for KV blocks") as e:  # needs 8 blocks, 4 free
            eng.submit(PrefillRequest("starved", (1,) * 60)).result(timeout=30)
        assert e.value.http_status == 503 and "leases" in e.value.message
        eng.abort("long")
    finally:
        eng.stop()


def test_health_follows_a_decode_that_dies_and_comes_back(stack):
    svc, decode, url = stack
    decode.healthy = False
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 200  # (not known yet: checked every 5 s)
    app = BackgroundServer(create_app(svc, DecodeClient(decode.url), decode_health_interval_s=0.2)).start()
    try:
        assert wait_for(lambda: httpx.get(app.url + "/health").status_code == 503, 5.0)
        r = httpx.post(app.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "is down" in r.json()["error"]["message"]
        decode.healthy = True
        assert wait_for(lambda: httpx.get(app.url + "/health").status_code == 200, 5.0)
        assert httpx.post(app.url + "/v1/completions", json={"prompt": "hi"}).status_code == 200
    finally:
        app.stop()


def test_disconnect_watch_leaves_keep_alive_connections_working(stack):
    """The guard's watch on a connection ends with each response: the next request on the same
    connection is served, not cancelled."""
    svc, decode, url = stack
    with httpx.Client(base_url=url) as c:
        for _ in range(3):
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert counter(svc, "requests", "ok") == 3 and counter(svc, "requests", "cancelled") == 0



def test_a_client_closing_right_after_done_is_ok_not_cancelled():
    """Many clients close a stream as soon as they read [DONE]; the answer reached them whole."""
    svc = make_service(num_blocks=64, max_queue_wait_s=30.0)
    svc.worker.engine.start()
    try:
        with FakeDecode(after_done_s=1.0) as decode, BackgroundServer(create_app(svc, DecodeClient(decode.url))) as gw:
            before = counter(svc, "requests", "ok"), counter(svc, "requests", "cancelled")
            with httpx.stream("POST", gw.url + "/v1/completions", json={"prompt": "hi", "stream": True},
                              timeout=30) as r:
                for line in r.iter_lines():
                    if line.strip() == "data: [DONE]":
                        break
            assert wait_for(lambda: counter(svc, "requests", "ok") == before[0] + 1, 5.0)
            assert counter(svc, "requests", "cancelled") == before[1]
    finally:
        svc.worker.engine.stop()


def test_the_decode_is_sent_its_own_model_name():
    """With --served-model-name the clients' model id differs from the decode's: the decode is sent
    its own (vLLM answers 404 to any other), whatever the client named, and the answer names the
    model as the clients do, streamed or not."""
    from prefill_server.serving.decodes import Decode, DecodeSet

    svc = make_service(num_blocks=64, max_queue_wait_s=30.0)
    svc.worker.engine.start()
    try:
        with FakeDecode(model="decode-name") as decode:
            decodes = DecodeSet([Decode(DecodeClient(decode.url), "", "decode-name")])
            with BackgroundServer(create_app(svc, decodes)) as gw:
                for body in ({"prompt": "hello there", "model": svc.info.served_name}, {"prompt": "hello there"}):
                    r = httpx.post(gw.url + "/v1/completions", json=body | {"max_tokens": 3}, timeout=30)
                    assert r.status_code == 200, r.text
                    assert decode.requests[-1]["model"] == "decode-name"
                    assert r.json()["model"] == svc.info.served_name  # (as vLLM alone would name it)
                with httpx.stream("POST", gw.url + "/v1/completions", timeout=30,
                                  json={"prompt": "hello there", "max_tokens": 3, "stream": True}) as s:
                    events = [json.loads(line[5:]) for line in s.iter_lines()
                              if line.startswith("data:") and "[DONE]" not in line]
                assert events and {e["model"] for e in events} == {svc.info.served_name}
    finally:
        svc.worker.engine.stop()


def test_decode_timeout_bounds_the_whole_answer_and_leaves_the_decode_up():
    """--decode-timeout: an answer slower than it gets 504 DecodeTimeout (a stream: an error event and
    [DONE] after the events so far, however often the decode sent one); the decode is slow, not
    down, so the next request goes to it; a refused answer's KV is freed."""
    svc = make_service(num_blocks=64, max_queue_wait_s=30.0)
    svc.worker.engine.start()
    try:
        with FakeDecode(delay_s=3.0, tokens=8) as decode, \
                BackgroundServer(create_app(svc, DecodeClient(decode.url, timeout_s=1.0))) as gw:
            body = {"prompt": "hello there", "max_tokens": 8}
            t0 = time.monotonic()
            r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 504 and r.json()["error"]["type"] == "DecodeTimeout", r.text
            assert "--decode-timeout 1 s" in r.json()["error"]["message"] and time.monotonic() - t0 < 2.5
            assert wait_for(lambda: svc.worker.engine.pool.num_used == 0, 5.0)  # (its lease released)
            decode.delay_s, decode.token_s = 0.0, 0.3  # 8 events 0.3 s apart: each in time, the whole not
            with httpx.stream("POST", gw.url + "/v1/completions", json=body | {"stream": True}, timeout=30) as s:
                events = [line for line in s.iter_lines() if line.startswith("data:")]
            assert 2 <= len(events) - 2 < 8 and '"DecodeTimeout"' in events[-2] and events[-1] == "data: [DONE]"
            decode.token_s = 0.0
            r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text  # still up
    finally:
        svc.worker.engine.stop()


def test_a_decode_that_fails_requests_gets_a_502_saying_what_to_check(stack):
    """vLLM answers 500 to every request whose KV it cannot read (e.g. a NIXL compatibility hash
    mismatch, said only in its own log): the client gets 502 naming the decode and the flags to
    check, streamed or not; the decode stays up (it answers); the KV is freed."""
    svc, decode, url = stack
    decode.fail_status = 500
    for stream in (False, True):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 3, "stream": stream},
                       timeout=30)
        assert r.status_code == 502, r.text
        msg = r.json()["error"]["message"]
        assert decode.url in msg and "Internal server error" in msg and "--dtype" in msg, msg
        assert wait_for(lambda: svc.worker.engine.pool.num_used == 0, 5.0)
    decode.fail_status = None
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text

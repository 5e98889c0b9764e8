"""The gRPC API over the real engine (tiny model): results, errors by field, pool exhaustion, API key,
TLS, deadlines and cancellation freeing KV at once, the streaming events and the client library."""
import asyncio
import json
import os
import shutil
import subprocess
import time

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_harness import BOS, GrpcHarness, make_service

from prefill_server.client import (AsyncPrefillClient, DecodeFailed, PrefillClient, PrefillRpcError,
                                   stream_completion)
from prefill_server.serving.auth import ApiKeys
from prefill_server.serving.grpc_server import PrefillServicer, start_grpc
from prefill_server.serving.pb import prefill_pb2 as pb

CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def h():
    harness = GrpcHarness()
    yield harness
    harness.close()


@pytest.fixture()
def client(h):
    h.model.delay_s = 0.0
    with PrefillClient(h.target, timeout=30) as c:
        yield c
    h.model.delay_s = 0.0
    assert h.wait_pool_empty() == 0, "a test leaked KV blocks"


def raw_call(h, request: pb.PrefillRequest | bytes, method="Prefill"):
    """(status code, details, trailing metadata dict) of one call with a hand-built request."""
    with grpc.insecure_channel(h.target) as ch:
        path = f"/prefill.v1.PrefillService/{method}"
        data = request if isinstance(request, bytes) else request.SerializeToString()
        try:
            if method == "PrefillStream":
                list(ch.unary_stream(path)(data, timeout=30))
            else:
                ch.unary_unary(path)(data, timeout=30)
            return CODE.OK, "", {}
        except grpc.RpcError as e:
            return e.code(), e.details(), dict(e.trailing_metadata() or ())


def test_prefill_returns_the_models_first_token_and_kv_params(h, client):
    ids = [BOS, 5, 17, 99, 3, 250, 1, 2, 3, 4, 5]
    r = client.prefill(ids)
    assert r.first_token_id == h.model.reference_next_token(ids)
    assert r.prompt_tokens == len(ids) and r.cached_tokens == 0 and r.model == "tiny"
    assert r.transfer_mode == "local" and r.prompt_token_ids is None
    assert r.kv_transfer_params["num_tokens"] == len(ids) and len(r.kv_transfer_params["block_ids"]) == 2
    assert r.timings["total_s"] >= r.timings["prefill_s"] > 0 and r.timings["tokenize_s"] == 0
    assert h.pool.num_used == 2  # held for the decode until released
    assert client.release(r.request_id) is True
    assert client.release(r.request_id) is False and h.pool.num_used == 0


def test_text_chat_and_chunked_prompts(h, client):
    r = client.prefill("héllo", return_prompt_token_ids=True)
    assert r.prompt_token_ids == [BOS] + list("héllo".encode())
    assert r.first_token_id == h.model.reference_next_token(r.prompt_token_ids) and r.timings["tokenize_s"] > 0
    client.release(r.request_id)
    r = client.prefill("hi", add_special_tokens=False, return_prompt_token_ids=True)
    assert r.prompt_token_ids == list(b"hi")
    client.release(r.request_id)
    r = client.prefill(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                       return_prompt_token_ids=True)
    assert bytes(r.prompt_token_ids).decode() == "<system>Be brief.\n<user>Hi\n<assistant>"
    client.release(r.request_id)
    roles = ["ipython", "function", "USER", ""]  # any role, as HTTP and vLLM take it: the template's to refuse
    r = client.prefill(messages=[{"role": x, "content": "a"} for x in roles], return_prompt_token_ids=True)
    assert bytes(r.prompt_token_ids).decode() == "<ipython>a\n<function>a\n<USER>a\n<>a\n<assistant>"
    client.release(r.request_id)
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}],
        "tools": [{"type": "function", "function": {"name": "f"}}], "add_generation_prompt": True}
    r = client.prefill(chat=chat, return_prompt_token_ids=True)  # as HTTP renders it: arguments as objects
    assert bytes(r.prompt_token_ids).decode() == '<tools>f\n<user>Hi\n<assistant>[f{"x": 1}]\n<tool>2\n<assistant>'
    client.release(r.request_id)
    long = [(7 * i) % 256 for i in range(180)]  # 3 chunks of the 64-token budget, 23 of 24 blocks
    r = client.prefill(long, request_id="my.long-request_1")
    assert r.request_id == "my.long-request_1"
    assert r.first_token_id == h.model.reference_next_token(long)
    client.release("my.long-request_1")


@pytest.mark.parametrize("sampling", [dict(temperature=1e-300), dict(temperature=1.0, top_p=5e-324),
                                      dict(temperature=1e300, top_k=2**31 - 1, seed=2**63 - 1),
                                      dict(temperature=0.8, top_p=0.9, top_k=5, seed=7)])
def test_extreme_sampling_values_are_served(h, client, sampling):
    r = client.prefill([1, 2, 3], **sampling)
    assert 0 <= r.first_token_id < 260
    if sampling.get("seed") == 7:  # seeded sampling is reproducible
        client.release(r.request_id)
        r2 = client.prefill([1, 2, 3], **sampling)
        assert r2.first_token_id == r.first_token_id
        r = r2
    client.release(r.request_id)


def test_list_workers_without_a_pool_is_this_process(h, client):
    r = client.list_workers()
    assert r.routing == "" and [w.worker for w in r.workers] == ["local"]
    w = r.workers[0]
    assert w.pid == os.getpid() and w.total_kv_blocks == 24 and w.free_kv_blocks == 24 and w.outstanding_tokens == 0


def test_server_info_health_and_reflection(h, client):
    info = client.server_info()
    assert (info.model, info.num_layers, info.num_kv_heads, info.head_dim, info.block_size) == ("tiny", 2, 2, 8, 8)
    assert info.kv_layout == "LBHNC" and info.kv_dtype == "float32" and info.api_version == "prefill.v1"
    assert list(info.supported_transfer_modes) == [pb.TRANSFER_MODE_LOCAL]
    assert info.num_kv_blocks == 24 and info.num_free_kv_blocks == 24
    assert {"torch", "grpcio", "protobuf"} <= set(info.versions) and info.server_version
    assert client.health() == "SERVING" and client.health("prefill.v1.PrefillService") == "SERVING"
    with grpc.insecure_channel(h.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        (resp,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in resp.list_services_response.service}
        assert {"prefill.v1.PrefillService", "grpc.health.v1.Health"} <= names
        (resp,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="prefill.v1.PrefillService")]))
        assert resp.file_descriptor_response.file_descriptor_proto  # grpcurl can describe the API


def _req(**kw) -> pb.PrefillRequest:
    return pb.PrefillRequest(**kw)


BAD = [
    ("empty input", _req(), "input", "empty"),
    ("empty text", _req(text=""), "input", "empty"),
    ("both text and tokens", _req(token_ids=[1, 2], text="x"), "input", "token_ids and text"),
    ("tokens and messages", _req(token_ids=[1], messages=[pb.ChatMessage(role="user", content="x")]), "input",
     "token_ids and messages"),
    ("messages and chat_json", _req(messages=[pb.ChatMessage(role="user", content="x")], chat_json="{}"), "input",
     "messages and chat_json"),
    ("chat_json not JSON", _req(chat_json="{messages"), "chat_json", "JSON object"),
    ("chat_json not an object", _req(chat_json="[1]"), "chat_json", "JSON object"),
    ("chat_json without messages", _req(chat_json='{"tools": []}'), "chat_json.messages", "messages"),
    ("chat_json tool call vLLM refuses", _req(chat_json=json.dumps({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}]})),
     "chat_json.messages.0.tool_calls.0", "arguments"),
    ("chat_json with its own template", _req(chat_json='{"messages": [{"role": "user", "content": "x"}], '
                                                       '"chat_template": "{{ 1 }}"}'), "chat_json.chat_template",
     "chat_template"),
    ("unknown model", _req(text="x", model="gpt-5"), "model", "not served here"),
    ("longer than the context", _req(token_ids=[1] * 300), "token_ids", "context"),
    ("longer than the pool", _req(token_ids=[1] * 200), "token_ids", "shorter prompt"),
    ("text too long", _req(text="a" * 230), "text", "shorter prompt"),
    ("negative token id", _req(token_ids=[1, -3]), "token_ids", "-3"),
    ("token id past the vocabulary", _req(token_ids=[260]), "token_ids", "vocabulary"),
    ("negative temperature", _req(text="x", sampling=pb.SamplingParams(temperature=-0.5)), "sampling.temperature",
     ">= 0"),
    ("nan temperature", _req(text="x", sampling=pb.SamplingParams(temperature=float("nan"))),
     "sampling.temperature", "finite"),
    ("top_p zero", _req(text="x", sampling=pb.SamplingParams(top_p=0.0)), "sampling.top_p", "(0, 1]"),
    ("negative top_k", _req(text="x", sampling=pb.SamplingParams(top_k=-5)), "sampling.top_k", "-5"),
    ("negative seed", _req(text="x", sampling=pb.SamplingParams(seed=-1)), "sampling.seed", ">= 0"),
    ("transfer mode the server does not run", _req(text="x", transfer_mode=pb.TRANSFER_MODE_NIXL_PULL),
     "transfer_mode", "TRANSFER_MODE_LOCAL"),
    ("unknown transfer mode", _req(text="x", transfer_mode=42), "transfer_mode", "42"),
    ("transfer target without push", _req(text="x", transfer_target=pb.TransferTarget(engine_id="e")),
     "transfer_target", "PUSH"),
    ("bad request id", _req(text="x", request_id="a b"), "request_id", "characters"),
    ("add_special_tokens on token ids", _req(token_ids=[1], add_special_tokens=True), "add_special_tokens", "text"),
]


@pytest.mark.parametrize("request_,field,needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
@pytest.mark.parametrize("method", ["Prefill", "PrefillStream"])
def test_bad_input_is_invalid_argument_naming_the_field(h, client, method, request_, field, needle):
    code, details, md = raw_call(h, request_, method)
    assert code == CODE.INVALID_ARGUMENT, (code, details)
    assert md["prefill-error-field"] == field
    assert details.startswith(f"{field}: ") and needle in details, details
    assert h.pool.num_used == 0


def test_malformed_messages_and_bad_release_ids(h, client):
    for method in ("Prefill", "PrefillStream", "Release", "GetServerInfo", "ListWorkers"):
        code, details, md = raw_call(h, b"\xff\xff\xff", method)
        assert code == CODE.INVALID_ARGUMENT and md["prefill-error-field"] == "request", (method, code, details)
    for rid in ("", "x" * 201, "a,b", "a b", "HB:x"):  # (kv_transfer.base.check_request_id)
        with pytest.raises(PrefillRpcError) as ei:
            client.release(rid)
        assert ei.value.code == CODE.INVALID_ARGUMENT and ei.value.field == "request_id"
    assert client.release("never-seen") is False
    assert client.server_info().num_free_kv_blocks == 24  # still serving


def test_request_id_in_use(h, client):
    r = client.prefill([1, 2, 3], request_id="dup")
    with pytest.raises(PrefillRpcError) as ei:
        client.prefill([4, 5], request_id="dup")
    assert ei.value.code == CODE.INVALID_ARGUMENT and ei.value.field == "request_id"
    assert client.release(r.request_id)


def test_full_pool_is_resource_exhausted_then_recovers(h, client):
    held = [client.prefill([i] * 96) for i in (1, 2)]  # 12 blocks each: the whole pool
    assert h.pool.num_free == 0
    t0 = time.monotonic()
    with pytest.raises(PrefillRpcError) as ei:
        client.prefill([3] * 8)
    assert ei.value.code == CODE.RESOURCE_EXHAUSTED and "retry later" in ei.value.message
    assert time.monotonic() - t0 >= 0.5  # waited max_queue_wait_s for blocks first
    for r in held:
        client.release(r.request_id)
    assert h.pool.num_used == 0
    client.release(client.prefill([3] * 8).request_id)


def test_deadline_frees_kv_at_once(h, client):
    h.model.delay_s = 0.25  # 180 tokens = 3 steps of 64 = 0.75 s
    with pytest.raises(PrefillRpcError) as ei:
        client.prefill([1] * 180, timeout=0.4)
    assert ei.value.code == CODE.DEADLINE_EXCEEDED
    assert h.wait_pool_empty(timeout=1.0) == 0  # aborted, not left to the 30 s lease
    assert not h.service.worker.engine.scheduler.has_work()
    h.model.delay_s = 0.0
    client.release(client.prefill([1] * 180).request_id)  # the engine still serves


def test_stream_events_and_early_exit_cancels(h, client):
    h.model.delay_s = 0.1
    ids = [(3 * i) % 256 for i in range(180)]
    events = list(client.prefill_stream(ids, return_prompt_token_ids=True))
    kinds = [e.kind for e in events]
    assert kinds[:2] == ["queued", "started"] and kinds[-1] == "result", kinds
    progress = [e.tokens_done for e in events if e.kind == "progress"]
    assert len(progress) >= 2 and progress == sorted(set(progress)) and progress[-1] == 180, progress
    assert all(e.prompt_tokens == 180 for e in events)
    assert [e.elapsed_s for e in events] == sorted(e.elapsed_s for e in events)
    result = events[-1].result
    assert result.first_token_id == h.model.reference_next_token(ids)
    client.release(result.request_id)
    for e in client.prefill_stream(ids):  # leave after the first progress: the call is cancelled
        if e.kind == "progress":
            break
    assert h.wait_pool_empty(timeout=1.0) == 0
    for e in client.prefill_stream(ids):  # leave at the result: the KV stays for the decode
        if e.kind == "result":
            break
    time.sleep(0.2)
    assert h.pool.num_used == 23 and client.release(e.result.request_id)


def test_async_client_and_task_cancellation(h, client):
    async def main():
        async with AsyncPrefillClient(h.target, timeout=30) as c:
            r = await c.prefill("async", return_prompt_token_ids=True)
            assert r.first_token_id == h.model.reference_next_token(r.prompt_token_ids)
            assert await c.release(r.request_id)
            assert (await c.server_info()).model == "tiny" and await c.health() == "SERVING"
            events = [e async for e in c.prefill_stream([1, 2, 3])]
            assert events[0].kind == "queued" and events[-1].kind == "result"
            assert await c.release(events[-1].result.request_id)
            h.model.delay_s = 0.2
            task = asyncio.create_task(c.prefill([1] * 180))
            await asyncio.sleep(0.3)
            assert h.pool.num_used > 0
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            with pytest.raises(PrefillRpcError) as ei:
                await c.prefill("x", timeout=5, model="nope")
            assert ei.value.code == CODE.INVALID_ARGUMENT and ei.value.field == "model"
    asyncio.run(main())
    assert h.wait_pool_empty(timeout=1.0) == 0


def test_result_published_after_the_call_was_cancelled_is_freed(h, client):
    """The race the done callback closes: the KV is published, then the call still ends cancelled."""
    class Ctx:
        callbacks = []

        def add_done_callback(self, cb):
            self.callbacks.append(cb)

        def cancelled(self):
            return True

    ctx = Ctx()
    servicer = PrefillServicer(h.service)
    resp = h.run(servicer.Prefill(pb.PrefillRequest(token_ids=[1, 2, 3]).SerializeToString(), ctx))
    assert resp.usage.prompt_tokens == 3 and h.pool.num_used == 1
    for cb in ctx.callbacks:
        cb(ctx)
    assert h.pool.num_used == 0


def test_api_key():
    hk = GrpcHarness(make_service(), api_keys=ApiKeys("s3cret"))
    try:
        for key in (None, "wrong", "s3cret "):
            with PrefillClient(hk.target, api_key=key) as c:
                with pytest.raises(PrefillRpcError) as ei:
                    c.prefill("x")
                assert ei.value.code == CODE.UNAUTHENTICATED and "Bearer" in ei.value.message
                with pytest.raises(PrefillRpcError) as ei:
                    list(c.prefill_stream("x"))
                assert ei.value.code == CODE.UNAUTHENTICATED
                with pytest.raises(PrefillRpcError):
                    c.release("x")
                assert c.health() == "SERVING"  # probes need no key
        with PrefillClient(hk.target, api_key="s3cret") as c:
            assert c.release(c.prefill("x").request_id)
            assert c.server_info().model == "tiny"
        assert hk.pool.num_used == 0
    finally:
        hk.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    ht = GrpcHarness(make_service(), tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"),
                     api_keys=ApiKeys("k"))
    try:
        ca = (tmp_path / "cert.pem").read_bytes()
        with PrefillClient(ht.target, root_certificates=ca, api_key="k") as c:
            assert c.release(c.prefill("over tls").request_id)
        with PrefillClient(ht.target, api_key="k", timeout=2) as c:  # plaintext to a TLS port
            with pytest.raises(PrefillRpcError) as ei:
                c.prefill("x")
            assert ei.value.code == CODE.UNAVAILABLE
    finally:
        ht.close()


def test_start_grpc_refuses_bad_config(h):
    with pytest.raises(ValueError, match="both"):
        h.run(start_grpc(h.service, tls_cert="/x.pem"))
    with pytest.raises(ValueError, match="no-such-file"):
        h.run(start_grpc(h.service, tls_cert="/no-such-file", tls_key="/no-such-file"))
    with pytest.raises(OSError, match="in use"):
        h.run(start_grpc(h.service, "127.0.0.1", h.server.port))


def test_pipeline_helper_sends_our_tokens_and_params_and_releases_on_decode_error(h, client):
    seen = []

    def decode(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body["max_tokens"] == 99:
            return httpx.Response(500, json={"error": "boom"})
        sse = "".join(f"data: {json.dumps({'choices': [{'text': t}]})}\n\n" for t in ("Hel", "lo")) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    http = httpx.Client(transport=httpx.MockTransport(decode))
    out = "".join(stream_completion(client, "http://decode", "hi", max_tokens=5, http=http, ignore_eos=True))
    assert out == "Hello"
    body = seen[0]
    assert body["prompt"] == [BOS] + list(b"hi") and body["model"] == "tiny" and body["stream"] is True
    assert body["kv_transfer_params"]["num_tokens"] == 3 and body["ignore_eos"] is True
    client.release(body["kv_transfer_params"]["request_id"])  # local mode: no decode frees it
    with pytest.raises(DecodeFailed, match="500"):
        list(stream_completion(client, "http://decode", "hi", max_tokens=99, http=http))
    assert h.pool.num_used == 0  # released because the decode refused

"""Random protobuf messages (and random bytes) at every method: the server answers each with OK or a
deliberate status (never UNKNOWN or INTERNAL), keeps serving, and the pool drains to zero blocks."""
import json

import grpc
import pytest
from grpc_harness import GrpcHarness
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefill_server.serving.pb import prefill_pb2 as pb

CODE = grpc.StatusCode
ALLOWED = {CODE.OK, CODE.INVALID_ARGUMENT, CODE.RESOURCE_EXHAUSTED}
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
REQUEST_IDS = st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True), st.text(max_size=140))

token_ids = st.one_of(
    st.lists(st.integers(0, 259), min_size=1, max_size=80),
    st.lists(st.integers(-3, 262), min_size=1, max_size=80),
    st.lists(INT32, min_size=1, max_size=8),
    st.integers(150, 320).map(lambda n: [1] * n),  # around the pool (192) and context (256) limits
)
sampling = st.builds(
    lambda t, p, k, s: pb.SamplingParams(**{n: v for n, v in (("temperature", t), ("top_p", p), ("top_k", k),
                                                                ("seed", s)) if v is not None}),
    st.none() | FLOATS | st.sampled_from([0.0, 1e-300, 1e-5, 0.7, 1.0, 1e300]),
    st.none() | FLOATS | st.sampled_from([5e-324, 1e-300, 1e-6, 0.5, 1.0]),
    st.none() | INT32 | st.sampled_from([-1, 0, 1, 5]), st.none() | INT64)
ROLES = st.sampled_from(["user", "system", "assistant", "tool"])
messages = st.lists(st.builds(pb.ChatMessage, role=ROLES | ROLES | ROLES | st.text(max_size=10),
                              content=st.text(max_size=40)), min_size=1, max_size=4)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | FLOATS | st.text(max_size=10),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                    max_leaves=8)
chat_json = st.one_of(  # a chat body (messages with tool calls, tools, template fields), any JSON, or not JSON
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": ROLES | st.text(max_size=6), "content": st.none() | st.text(max_size=30)},
        optional={"tool_calls": JSON, "tool_call_id": JSON, "name": JSON, "reasoning_content": JSON}), max_size=3)},
        optional={"tools": JSON, "chat_template_kwargs": JSON, "add_generation_prompt": JSON,
                  "continue_final_message": JSON, "documents": JSON}).map(json.dumps),
    JSON.map(json.dumps), st.text(max_size=30))


def sometimes(draw, valid, invalid, one_in=5):
    """A valid value mostly, so that most examples get past the first check and reach the engine
    (the middle value, because hypothesis favours the bounds)."""
    return draw(invalid) if draw(st.integers(0, one_in - 1)) == one_in // 2 else draw(valid)


@st.composite
def prefill_requests(draw) -> pb.PrefillRequest:
    req = pb.PrefillRequest(
        model=sometimes(draw, st.sampled_from(["", "tiny", "/models/tiny"]), st.text(max_size=20)),
        transfer_mode=sometimes(draw, st.sampled_from([0, 3]), st.sampled_from([1, 2]) | INT32),
        request_id=sometimes(draw, st.just("") | st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True),
                             st.text(max_size=140)),
        return_prompt_token_ids=draw(st.booleans()))
    for kind in sometimes(draw, st.sampled_from([("token_ids",), ("text",), ("messages",), ("chat_json",)]),
                          st.sampled_from([(), ("token_ids", "text"), ("text", "messages"),
                                           ("token_ids", "messages"), ("messages", "chat_json")]), one_in=8):
        if kind == "token_ids":
            req.token_ids.extend(draw(token_ids))
        elif kind == "text":
            req.text = draw(st.text(min_size=1, max_size=60))
        elif kind == "chat_json":
            req.chat_json = draw(chat_json)
        else:
            req.messages.extend(draw(messages))
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling))
    if draw(st.integers(0, 9)) == 5:
        req.add_special_tokens = draw(st.booleans())
    if draw(st.integers(0, 19)) == 10:
        req.transfer_target.engine_id = draw(st.text(max_size=8))
    return req


@pytest.fixture(scope="module")
def h():
    harness = GrpcHarness()
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def channel(h):
    with grpc.insecure_channel(h.target) as ch:
        yield ch


def call(channel, method: str, data: bytes, stream=False):
    """(code, responses) of one call with serialized request bytes."""
    path = f"/prefill.v1.PrefillService/{method}"
    try:
        if stream:
            return CODE.OK, list(channel.unary_stream(path)(data, timeout=30))
        return CODE.OK, [channel.unary_unary(path)(data, timeout=30)]
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, (method, e.code(), e.details())
        return e.code(), []


def release_all(channel, responses, parse) -> None:
    for raw in responses:
        rid = parse(raw)
        if rid:
            _, (r,) = call(channel, "Release", pb.ReleaseRequest(request_id=rid).SerializeToString())
            assert pb.ReleaseResponse.FromString(r).released


def _result_rid(raw: bytes) -> str | None:
    e = pb.PrefillEvent.FromString(raw)
    return e.result.request_id if e.WhichOneof("event") == "result" else None


@SETTINGS
@given(req=prefill_requests())
def test_prefill_random_messages(h, channel, req):
    code, out = call(channel, "Prefill", req.SerializeToString())
    release_all(channel, out, lambda raw: pb.PrefillResponse.FromString(raw).request_id)
    assert h.pool.num_used == 0


@SETTINGS
@given(req=prefill_requests())
def test_prefill_stream_random_messages(h, channel, req):
    code, out = call(channel, "PrefillStream", req.SerializeToString(), stream=True)
    if code == CODE.OK:
        kinds = [pb.PrefillEvent.FromString(raw).WhichOneof("event") for raw in out]
        assert kinds[0] == "queued" and kinds[-1] == "result" and kinds.count("result") == 1
    release_all(channel, out, _result_rid)
    assert h.pool.num_used == 0


@SETTINGS
@given(rid=REQUEST_IDS)
def test_release_random_ids(h, channel, rid):
    code, out = call(channel, "Release", pb.ReleaseRequest(request_id=rid).SerializeToString())
    assert code in (CODE.OK, CODE.INVALID_ARGUMENT)
    if out:
        assert pb.ReleaseResponse.FromString(out[0]).released is False  # nothing of that id is held


@SETTINGS
@given(method=st.sampled_from(["Prefill", "PrefillStream", "Release", "GetServerInfo"]), data=st.binary(max_size=64))
def test_random_bytes_at_every_method(h, channel, method, data):
    code, out = call(channel, method, data, stream=method == "PrefillStream")
    if method == "Prefill":
        release_all(channel, out, lambda raw: pb.PrefillResponse.FromString(raw).request_id)
    elif method == "PrefillStream":
        release_all(channel, out, _result_rid)
    assert h.pool.num_used == 0


def test_still_serving_after_the_fuzzing(h, channel):
    _, (raw,) = call(channel, "GetServerInfo", b"")
    info = pb.ServerInfo.FromString(raw)
    assert info.num_free_kv_blocks == info.num_kv_blocks == 24
    _, (raw,) = call(channel, "Prefill", pb.PrefillRequest(text="still here").SerializeToString())
    release_all(channel, [raw], lambda r: pb.PrefillResponse.FromString(r).request_id)
    assert h.pool.num_used == 0 and h.pool.num_leases == 0

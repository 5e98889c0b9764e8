"""The prefix cache seen from gRPC over the real engine (tiny model, 8-token blocks): cached_tokens in
the usage (whole blocks, the cached blocks reused, the same first token), the metrics, and the admin
ResetPrefixCache (the API key when one is set; a success that frees nothing without a prefix cache,
as POST /reset_prefix_cache answers)."""
import grpc
import pytest
from fastapi.testclient import TestClient
from grpc_harness import BOS, GrpcHarness, make_service

from prefill_server.client import PrefillClient, PrefillRpcError
from prefill_server.serving.auth import ApiKeys
from prefill_server.serving.http import create_app
from prefill_server.serving.pb import prefill_pb2 as pb

CODE = grpc.StatusCode
KEY = "s3cret"
BLOCK = 8
HEAD = [BOS] + [(11 * i + 3) % 256 for i in range(43)]  # 44 tokens: 5 full blocks + 4 tokens


@pytest.fixture(scope="module")
def h():
    harness = GrpcHarness(make_service(prefix_cache=True), api_keys=ApiKeys(KEY))
    yield harness
    harness.close()


@pytest.fixture()
def client(h):
    with PrefillClient(h.target, api_key=KEY, timeout=30) as c:
        reset(c)  # every test starts from an empty cache
        yield c
    assert h.wait_pool_empty() == 0, "a test leaked KV blocks"


def reset(c: PrefillClient) -> pb.ResetPrefixCacheResponse:
    return c.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), metadata=c.config.metadata(), timeout=30)


def metric(h, name: str) -> float:
    """A sample as a /metrics scrape renders it (the scrape brings the gauges up to date)."""
    text = h.service.worker.render_metrics().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_repeated_prompt_is_cached_in_whole_blocks_until_reset(h, client):
    hits0, queries0 = metric(h, "prefill_server:prefix_cache_hits_total"), \
        metric(h, "prefill_server:prefix_cache_queries_total")
    want = h.model.reference_next_token(HEAD)
    first = client.prefill(HEAD)
    assert first.cached_tokens == 0 and first.prompt_tokens == len(HEAD) and first.first_token_id == want
    client.release(first.request_id)
    assert h.pool.num_used == 0 and h.pool.cache.num_cached == 5  # the 5 full blocks, parked
    assert metric(h, "prefill_server:prefix_cache_blocks") == 5

    second = client.prefill(HEAD)
    # every full block but the one of the last prompt token (its logits give the first token)
    assert second.cached_tokens == 40 and second.cached_tokens % BLOCK == 0
    assert second.first_token_id == want  # the cached K/V gives the model's own answer
    assert second.kv_transfer_params["cached_tokens"] == 40
    assert second.kv_transfer_params["block_ids"][:5] == first.kv_transfer_params["block_ids"][:5]
    assert metric(h, "prefill_server:prefix_cache_hits_total") - hits0 == 40
    assert metric(h, "prefill_server:prefix_cache_queries_total") - queries0 == 2 * len(HEAD)
    client.release(second.request_id)

    streamed = [e for e in client.prefill_stream(HEAD + [7, 8, 9]) if e.kind == "result"][0].result
    assert streamed.cached_tokens == 40  # the same head, streamed, with a longer tail
    client.release(streamed.request_id)

    cached = h.pool.cache.num_cached
    assert cached == 5 and h.pool.num_used == 0
    r = reset(client)
    assert r.reset is True and r.blocks_freed == cached
    assert h.pool.cache.num_cached == 0 and metric(h, "prefill_server:prefix_cache_blocks") == 0
    assert client.server_info().num_free_kv_blocks == 24  # every block free again
    assert client.reset_prefix_cache() == 0  # nothing left to forget (the client library's call)

    third = client.prefill(HEAD)
    assert third.cached_tokens == 0 and third.first_token_id == want
    client.release(third.request_id)
    assert metric(h, "prefill_server:prefix_cache_hits_total") - hits0 == 80  # second + streamed only


def test_reset_keeps_blocks_in_use_with_their_holders(h, client):
    held = client.prefill(HEAD)  # its KV is leased (in use), its 5 full blocks named
    other = [BOS] + [(5 * i + 1) % 256 for i in range(16)]  # 17 tokens: 2 full blocks
    client.release(client.prefill(other).request_id)  # parked
    used = h.pool.num_used
    r = reset(client)
    assert r.reset is True and r.blocks_freed == 2  # only the unreferenced ones
    assert h.pool.num_used == used and h.pool.cache.num_cached == 0
    again = client.prefill(HEAD)
    assert again.cached_tokens == 0  # the held blocks are no longer named
    assert again.first_token_id == held.first_token_id
    client.release(again.request_id)
    assert client.release(held.request_id) is True


def test_reset_needs_the_api_key(h, client):
    client.release(client.prefill(HEAD).request_id)
    assert h.pool.cache.num_cached == 5
    for key in (None, "wrong", KEY + " "):
        with PrefillClient(h.target, api_key=key) as c:
            with pytest.raises(grpc.RpcError) as ei:
                reset(c)
            assert ei.value.code() == CODE.UNAUTHENTICATED and "Bearer" in ei.value.details()
            assert dict(ei.value.trailing_metadata())["prefill-error-type"] == "Unauthenticated"
            with pytest.raises(PrefillRpcError) as pe:
                c.prefill(HEAD)
            assert pe.value.code == CODE.UNAUTHENTICATED
    assert h.pool.cache.num_cached == 5  # the refused calls reset nothing
    again = client.prefill(HEAD)
    assert again.cached_tokens == 40
    client.release(again.request_id)


def test_malformed_reset_request_is_invalid_argument(h, client):
    with grpc.insecure_channel(h.target) as ch:
        call = ch.unary_unary("/prefill.v1.PrefillService/ResetPrefixCache")
        with pytest.raises(grpc.RpcError) as ei:
            call(b"\xff\xff", metadata=(("authorization", f"Bearer {KEY}"),), timeout=30)
    assert ei.value.code() == CODE.INVALID_ARGUMENT
    assert dict(ei.value.trailing_metadata())["prefill-error-field"] == "request"


def test_without_a_prefix_cache_reset_succeeds_and_frees_nothing_as_http_does():
    hn = GrpcHarness(make_service())  # --no-prefix-cache
    try:
        assert hn.pool.cache is None
        with PrefillClient(hn.target, timeout=30) as c:
            for _ in range(2):
                r = c.prefill(HEAD)
                assert r.cached_tokens == 0
                c.release(r.request_id)
            g = reset(c)
            assert g.reset is True and g.blocks_freed == 0
        with TestClient(create_app(hn.service, None)) as http:
            resp = http.post("/reset_prefix_cache")
        assert resp.status_code == 200 and resp.json() == {"status": "ok", "blocks_freed": g.blocks_freed}
        assert hn.wait_pool_empty() == 0
    finally:
        hn.close()


def test_a_cache_salt_shares_cached_blocks_only_with_the_same_salt(h, client):
    def cached(salt: str | None) -> int:
        r = client.prefill(HEAD, cache_salt=salt)
        client.release(r.request_id)
        return r.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 40  # the same salt: its blocks
    assert cached("tenant-b") == 0 and cached(None) == 0  # another salt, none: not served by them
    assert cached("tenant-b") == 40 and cached(None) == 40
    for bad in ("x" * 129, "a/b", "a@b", "a\\b", "a\x00b"):
        with pytest.raises(PrefillRpcError) as ei:
            client.prefill(HEAD, cache_salt=bad)
        assert ei.value.code == CODE.INVALID_ARGUMENT and ei.value.field == "cache_salt", bad


def test_a_chat_json_cache_salt_isolates_its_prompt(h, client):
    """A chat_json body's own cache_salt applies (as the same body would over HTTP) where the request's
    field is empty; the same salt in the field shares its blocks; two different salts are refused."""
    chat = {"messages": [{"role": "user", "content": "salted " * 10}], "cache_salt": "tenant-c"}
    plain = {"messages": chat["messages"]}

    def cached(body: dict, salt: str | None = None) -> int:
        r = client.prefill(chat=body, cache_salt=salt)
        client.release(r.request_id)
        return r.cached_tokens

    assert cached(chat) == 0 and cached(chat) > 0
    assert cached(plain) == 0  # no salt: not served by the salted blocks
    assert cached(plain, salt="tenant-c") > 0 and cached(chat, salt="tenant-c") > 0
    with pytest.raises(PrefillRpcError) as ei:
        client.prefill(chat=chat, cache_salt="tenant-d")
    assert ei.value.code == CODE.INVALID_ARGUMENT and ei.value.field == "cache_salt"
    assert h.wait_pool_empty() == 0

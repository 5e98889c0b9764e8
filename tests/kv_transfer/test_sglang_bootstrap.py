"""The bootstrap server an SGLang decode talks to: the routes and status codes of SGLang 0.5.23's own
server, and hygiene (bad bodies change nothing, the server keeps serving)."""
from __future__ import annotations

import http.client
import json

import pytest

from kv_transfer.sglang import v0_5_23 as wire
from kv_transfer.sglang.bootstrap import BootstrapServer, RankTable

ALL = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
RANK0 = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"


@pytest.fixture()
def server():
    s = BootstrapServer(RankTable(), "127.0.0.1", 0)
    yield s
    s.close()


def call(server, method, path, body=None, raw=None):
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    return r.status, text


def rank(**kw):
    return {**json.loads(json.dumps(wire.our_rank("10.0.0.7", 6001, 16, "auto", 8000),
                                    default=lambda s: {f: getattr(s, f) for f in s.__struct_fields__})), **kw}


def test_health_and_route_as_sglang_serves_them(server):
    assert call(server, "GET", "/health") == (200, "OK")
    status, text = call(server, "GET", f"/route?{ALL}")
    assert status == 503 and "not fully registered" in text  # the decode retries until ready
    assert call(server, "PUT", "/route", rank()) == (200, "OK")
    status, text = call(server, "GET", f"/route?{ALL}")
    info = json.loads(text)
    assert status == 200 and (info["page_size"], info["kv_cache_dtype"], info["prefill_http_port"]) == (16, "auto", 8000)
    assert call(server, "GET", f"/route?{RANK0}") == (200, json.dumps({"rank_ip": "10.0.0.7", "rank_port": 6001}))
    assert call(server, "GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=3&target_pp_rank=0")[0] == 404
    assert call(server, "GET", "/route?prefill_dp_rank=0")[0] == 400
    assert call(server, "POST", "/query_dp_ranks", {"bootstrap_rooms": [5, 9]}) == (200, json.dumps({"5": 0, "9": 0}))


@pytest.mark.parametrize("body", [
    b"", b"not json", b"[]", b'{"attn_tp_size": 1}', json.dumps(rank(page_size=0)).encode(),
    json.dumps(rank(attn_tp_rank=1)).encode(), json.dumps(rank(rank_port="x")).encode(),
    json.dumps(rank(rank_ip="no spaces allowed")).encode()])
def test_bad_registrations_are_refused_and_change_nothing(server, body):
    status, _ = call(server, "PUT", "/route", raw=body)
    assert status in (400, 413)
    assert call(server, "GET", f"/route?{ALL}")[0] == 503
    assert call(server, "GET", "/health") == (200, "OK")


def test_a_rank_that_disagrees_with_the_first_is_refused(server):
    assert call(server, "PUT", "/route", rank())[0] == 200
    status, text = call(server, "PUT", "/route", rank(page_size=64, rank_port=6002))
    assert status == 400 and "differs" in text
    assert json.loads(call(server, "GET", f"/route?{ALL}")[1])["page_size"] == 16


def test_oversized_bodies_unknown_paths_and_methods(server):
    assert call(server, "PUT", "/route", raw=b"x" * (65 << 10))[0] == 413
    assert call(server, "GET", "/nothing")[0] == 404
    assert call(server, "DELETE", "/route")[0] == 501  # (http.server: no do_DELETE)
    assert call(server, "POST", "/route", rank())[0] == 405
    assert call(server, "GET", "/health") == (200, "OK")

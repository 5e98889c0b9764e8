"""The bootstrap server an SGLang decode asks where a prefill's ranks are (HTTP; SGLang's default
port 8998): ``PUT /route`` registers a rank, ``GET /route`` answers the server info or one rank's
ZMQ address, ``GET /health`` answers the decode's heartbeats. Its JSON is the pinned version's
(``v0_5_23``); this module is the table and the HTTP plumbing.

Hygiene: bodies are bounded and parsed into typed structs; anything malformed gets a 4xx with a
reason and changes nothing; a handler error is a 500, never a dead server thread.
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import msgspec

from kv_transfer.sglang import v0_5_23 as wire

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 10


class RankTable:
    """Registered prefill ranks, by (dp group, cp rank, tp rank, pp rank); the topology (sizes,
    page size, dtype, policies) is the first rank's, and every later rank must agree with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: wire.RankInfo | None = None
        self._ranks: dict[tuple[int, int, int, int], wire.RankInfo] = {}

    def register(self, r: wire.RankInfo) -> str | None:
        """Add (or replace) a rank; why not, or None."""
        if why := r.check():
            return why
        with self._lock:
            f = self._first
            if f is not None:
                mine = (f.attn_tp_size, f.attn_cp_size, f.dp_size, f.pp_size, f.page_size, f.kv_cache_dtype,
                        f.kv_layout, f.decode_allocation_policy)
                theirs = (r.attn_tp_size, r.attn_cp_size, r.dp_size, r.pp_size, r.page_size, r.kv_cache_dtype,
                          r.kv_layout, r.decode_allocation_policy)
                if mine != theirs:
                    return f"rank topology/KV format {theirs} differs from the registered ranks' {mine}"
            else:
                self._first = r
            self._ranks[(r.dp_group, r.attn_cp_rank, r.attn_tp_rank, r.pp_rank)] = r
        return None

    @property
    def ready(self) -> bool:
        with self._lock:
            f = self._first
            return f is not None and len(self._ranks) >= f.dp_size * f.attn_cp_size * f.attn_tp_size * f.pp_size

    def route(self, query: dict[str, str]) -> tuple[int, object]:
        """(HTTP status, JSON body or text) for ``GET /route``, as SGLang's server answers it."""
        try:
            dp, cp, tp, pp = (int(query[k]) for k in wire.ROUTE_QUERY)
        except (KeyError, ValueError):
            return 400, "Missing inputs for bootstrap server."
        with self._lock:
            n, first = len(self._ranks), self._first
            rank = self._ranks.get((dp, cp, tp, pp))
        if not self.ready or first is None:
            return 503, f"Prefill server not fully registered yet ({n} workers registered)."
        if (dp, cp, tp, pp) == (-1, -1, -1, -1):
            return 200, wire.server_info(first)
        if rank is None:
            return 404, (f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} "
                         f"pp_rank={pp}")
        return 200, {"rank_ip": rank.rank_ip, "rank_port": rank.rank_port}

    def dp_ranks(self, rooms: list) -> dict[str, int]:
        """``POST /query_dp_ranks``: one DP group here, so every room is rank 0's."""
        with self._lock:
            single = self._first is not None and self._first.dp_size == 1
        return {str(int(r)): 0 for r in rooms if single and isinstance(r, int) and 0 <= r <= wire.MAX_ROOM}


class BootstrapServer:
    """A threaded HTTP server over ``table`` on ``host``:``port`` (0: any free port; ``port`` then
    says which)."""

    def __init__(self, table: RankTable, host: str, port: int = 0):
        self.table = table
        handler = type("Handler", (_Handler,), {"table": table})
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="sglang-bootstrap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    table: RankTable
    timeout = 10  # a stalled client never holds a thread for long
    protocol_version = "HTTP/1.1"  # the decode keeps its heartbeat connection alive

    def log_message(self, fmt: str, *args) -> None:  # (the default writes every request to stderr)
        log.debug("bootstrap %s " + fmt, self.client_address[0], *args)

    def _reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes | None:
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY_BYTES:
            self._reply(413 if n > 0 else 400, "a JSON body of at most 64 KiB is required")
            return None
        return self.rfile.read(n)

    def _dispatch(self, method: str) -> None:
        try:
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            route = self._ROUTES.get((method, url.path))
            if route is None:
                self._reply(405 if url.path == "/route" else 404, f"no {method} {url.path} here")
            else:
                route(self, query)
        except Exception:  # noqa: BLE001 - a handler error is a 500, never a dead server
            log.exception("bootstrap server: %s %s failed", method, self.path[:200])
            try:
                self._reply(500, "internal error")
            except OSError:
                pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch("GET")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def _health(self, query: dict) -> None:
        self._reply(200, "OK")

    def _get_route(self, query: dict) -> None:
        self._reply(*self.table.route(query))

    def _put_route(self, query: dict) -> None:
        body = self._body()
        if body is None:
            return
        try:
            rank = msgspec.json.decode(body, type=wire.RankInfo)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._reply(400, f"bad rank registration: {e}")
        why = self.table.register(rank)
        self._reply(400 if why else 200, why or "OK")

    def _register_dp_rank(self, query: dict) -> None:
        if self._body() is not None:  # (one DP group: nothing to remember)
            self._reply(200, "OK")

    def _query_dp_ranks(self, query: dict) -> None:
        body = self._body()
        if body is None:
            return
        try:
            rooms = json.loads(body).get("bootstrap_rooms", [])
        except (ValueError, AttributeError):
            return self._reply(400, "want {\"bootstrap_rooms\": [int, ...]}")
        self._reply(200, self.table.dp_ranks(rooms if isinstance(rooms, list) else []))

    _ROUTES = {("GET", "/health"): _health, ("GET", "/route"): _get_route, ("PUT", "/route"): _put_route,
               ("POST", "/register_dp_rank"): _register_dp_rank, ("POST", "/query_dp_ranks"): _query_dp_ranks}

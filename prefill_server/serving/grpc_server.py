"""gRPC API (``prefill.v1.PrefillService`` on ``grpc.aio``), served beside the HTTP gateway on the same
``PrefillService`` (one engine, one event loop). The contract is ``proto/prefill/v1/prefill.proto``.

A call's life and who frees its KV:

    received ──validate + tokenize──> submitted (engine queue) ──> running ──> KV published (lease)
       │ bad input: INVALID_ARGUMENT        │ cancelled / deadline: the awaiting task is cancelled,
       │ (nothing allocated)                │ PrefillService.prefill aborts it in the engine (freed)
       v                                    v
    published: the response carries kv_transfer_params; the lease is the decode's to end. If the call
    is cancelled or times out after the KV is published but before the client got the response, the
    done callback releases the lease at once. ``Release`` ends a lease (or aborts a queued/running
    request) explicitly.

Errors: ``PrefillError`` subclasses map to their ``grpc_code``; the details start with the field path
and the trailing metadata carries ``prefill-error-field`` / ``prefill-error-type``. Anything else is a
bug: INTERNAL, logged with its traceback, and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import ipaddress
import json
import logging
import os
import sys
import time
import uuid

import google.protobuf
import grpc
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kv_transfer.base import check_request_id
from prefill_server.engine.worker import PrefillResult, check_client_salt
from prefill_server.errors import InvalidRequest, PrefillError, PromptTooLong
from prefill_server.serving.auth import ApiKeys
from prefill_server.serving.grpc_inputs import (Prepared, chat_messages, chat_request, chat_salt, in_chat_json,
                                                input_field, sampling_params)
from prefill_server.serving.pb import prefill_pb2 as pb
from prefill_server.serving.pb import prefill_pb2_grpc as pb_grpc
from prefill_server.serving.service import PrefillService

log = logging.getLogger(__name__)

API_VERSION = "prefill.v1"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PrefillService"].full_name  # "prefill.v1.PrefillService"
MAX_MESSAGE_BYTES = 64 * 2**20  # a 1M-token prompt is ~5 MB of token ids; the gRPC default is 4 MB
MODE_TO_PB = {"nixl-compat": pb.TRANSFER_MODE_NIXL_PULL, "connector": pb.TRANSFER_MODE_PUSH,
              "local": pb.TRANSFER_MODE_LOCAL}
_POLL_S = 0.02  # PrefillStream: how often the worker's progress is read
_MAX_DETAILS = 1000  # characters of error details (they may quote client input)
# Field names the engine and the service use -> the request's field paths.
_SAMPLING_FIELDS = {"temperature": "sampling.temperature", "top_p": "sampling.top_p",
                    "top_k": "sampling.top_k", "seed": "sampling.seed"}


# ---- errors ----

async def _abort(context: grpc.aio.ServicerContext, e: PrefillError) -> None:
    details = f"{e.field}: {e.message}" if e.field else e.message
    if len(details) > _MAX_DETAILS:
        details = details[:_MAX_DETAILS] + "..."
    md = [("prefill-error-type", type(e).__name__)] + ([("prefill-error-field", e.field)] if e.field else [])
    await context.abort(grpc.StatusCode[e.grpc_code], details, trailing_metadata=tuple(md))


def _internal(e: Exception) -> PrefillError:
    log.exception("internal error in a gRPC call")
    return PrefillError(f"internal error ({type(e).__name__}); the server logged the details")


def _parse(request, cls):
    """The handlers take raw bytes so that a malformed message is INVALID_ARGUMENT, not UNKNOWN."""
    if not isinstance(request, (bytes, bytearray)):
        return request  # registered elsewhere with the generated deserializers
    try:
        return cls.FromString(bytes(request))
    except DecodeError as e:
        raise InvalidRequest(f"the request is not a valid {cls.DESCRIPTOR.full_name} message ({e})",
                             field="request") from None


def _unary(cls, counted: bool = False):
    """counted: a prefill call, counted in requests_total by outcome (ok, cancelled, error class)."""
    def wrap(fn):
        @functools.wraps(fn)
        async def wrapper(self, request, context):
            count = self.count if counted else _ignore
            try:
                response = await fn(self, _parse(request, cls), context)
            except asyncio.CancelledError:  # the client cancelled, or its deadline passed
                count("cancelled")
                raise
            except PrefillError as e:
                count(type(e).__name__)
                await _abort(context, e)
            except Exception as e:  # a bug: never UNKNOWN, never a dead server
                count("InternalError")
                await _abort(context, _internal(e))
            else:
                count("ok")
                return response
        return wrapper
    return wrap


def _server_stream(cls, counted: bool = False):
    def wrap(fn):
        @functools.wraps(fn)
        async def wrapper(self, request, context):
            count = self.count if counted else _ignore
            try:
                async for event in fn(self, _parse(request, cls), context):
                    yield event
            except (asyncio.CancelledError, GeneratorExit):
                count("cancelled")
                raise
            except PrefillError as e:
                count(type(e).__name__)
                await _abort(context, e)
            except Exception as e:
                count("InternalError")
                await _abort(context, _internal(e))
            else:
                count("ok")
        return wrapper
    return wrap


def _ignore(_outcome: str) -> None:
    pass


def _renamed(e: PrefillError, input_field: str) -> PrefillError:
    """Engine/service field names ("prompt", "temperature") -> this request's field paths."""
    if e.field == "prompt" or isinstance(e, PromptTooLong):
        e.field = input_field
    elif e.field in _SAMPLING_FIELDS:
        e.field = _SAMPLING_FIELDS[e.field]
    return e


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, service: PrefillService):
        self.service = service
        self.mode = MODE_TO_PB[service.backend.name]

    def count(self, outcome: str) -> None:
        self.service.metrics.requests.labels(outcome).inc()

    async def _prepare(self, req: pb.PrefillRequest) -> Prepared:
        t0 = time.monotonic()
        field = input_field(req)
        self.service.check_model(req.model or None)
        if req.transfer_mode not in (pb.TRANSFER_MODE_UNSPECIFIED, self.mode):
            name = pb.TransferMode.Name(req.transfer_mode) if req.transfer_mode in pb.TransferMode.values() \
                else str(req.transfer_mode)
            raise InvalidRequest(f"this server runs {pb.TransferMode.Name(self.mode)}, not {name}; send that "
                                 "or TRANSFER_MODE_UNSPECIFIED", field="transfer_mode")
        if req.HasField("transfer_target") and req.transfer_mode != pb.TRANSFER_MODE_PUSH:
            raise InvalidRequest("only used with TRANSFER_MODE_PUSH; leave it unset", field="transfer_target")
        if req.request_id:
            check_request_id(req.request_id)
        salt = check_client_salt(req.cache_salt or None)  # (empty: none, as proto3 has it)
        if req.HasField("add_special_tokens") and field != "text":
            raise InvalidRequest("only applies to text input", field="add_special_tokens")
        sampling = sampling_params(req.sampling)
        t1 = time.monotonic()
        try:
            # through the service: --tokenizer-parity applies (the decode's /tokenize, the vocabulary check)
            if field == "token_ids":
                ids = await self.service.encode_prompt_async(list(req.token_ids))
            elif field == "text":
                add = req.add_special_tokens if req.HasField("add_special_tokens") else True
                ids = await self.service.encode_prompt_async(req.text, add_special_tokens=add)
            elif field == "chat_json":
                try:
                    messages, body = chat_request(req.chat_json)
                    ids = await self.service.encode_chat_async(messages, request=body)
                except InvalidRequest as e:
                    raise in_chat_json(e) from None
                salt = chat_salt(salt, body.get("cache_salt"))
            else:
                ids = await self.service.encode_chat_async(chat_messages(req))
        except PrefillError as e:
            raise _renamed(e, field) from None
        return Prepared(req.request_id or f"grpc-{uuid.uuid4().hex}", field, ids, sampling,
                        time.monotonic() - t1 if field != "token_ids" else 0.0, t0, salt)

    async def _prefill(self, p: Prepared, context: grpc.aio.ServicerContext) -> PrefillResult:
        try:
            result = await self.service.prefill(p.token_ids, p.sampling, p.request_id, cache_salt=p.cache_salt)
        except PrefillError as e:
            raise _renamed(e, p.input_field) from None
        # From here the KV is leased for the decode. If the call still ends cancelled (deadline hit,
        # client gone before it got the params), nobody will read it: free it now.
        service, rid = self.service, result.request_id

        def on_done(ctx) -> None:
            if ctx.cancelled():
                service.release(rid)
        context.add_done_callback(on_done)
        return result

    def _response(self, p: Prepared, r: PrefillResult, return_ids: bool) -> pb.PrefillResponse:
        tok = self.service.tokenizer
        try:  # the text the token adds after the prompt (a SentencePiece word's leading space included)
            text = tok.continuation_text(p.token_ids, r.first_token_id, False)
            text = tok.decode([r.first_token_id]) if text is None else text  # (part of a character)
        except Exception:  # an id beyond the tokenizer's vocabulary (padded lm_head)
            text = ""
        t = r.timings
        return pb.PrefillResponse(
            request_id=r.request_id, first_token_id=r.first_token_id, first_token_text=text,
            kv_transfer_params_json=json.dumps(r.kv_transfer_params, separators=(",", ":")),
            transfer_mode=self.mode, model=self.service.info.served_name,
            usage=pb.Usage(prompt_tokens=r.num_prompt_tokens, cached_tokens=r.num_cached_tokens),
            timings=pb.Timings(tokenize_seconds=p.tokenize_s, queue_seconds=t.queued_s,
                               prefill_seconds=t.prefill_s, total_seconds=time.monotonic() - p.t0),
            prompt_token_ids=p.token_ids if return_ids else ())

    # ---- RPCs ----
    @_unary(pb.PrefillRequest, counted=True)
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        p = await self._prepare(request)
        result = await self._prefill(p, context)
        return self._response(p, result, request.return_prompt_token_ids)

    @_server_stream(pb.PrefillRequest, counted=True)
    async def PrefillStream(self, request: pb.PrefillRequest, context):
        p = await self._prepare(request)
        total = len(p.token_ids)

        def event(**kw) -> pb.PrefillEvent:
            return pb.PrefillEvent(elapsed_seconds=time.monotonic() - p.t0, **kw)

        task = asyncio.ensure_future(self._prefill(p, context))
        try:
            await asyncio.sleep(0)  # let the task submit (bad input fails here, before any event)
            if task.done():
                task.result()
            worker = self.service.worker
            snap = worker.progress(p.request_id)
            ahead = snap.requests_ahead if snap and snap.state == "queued" else 0
            yield event(queued=pb.Queued(prompt_tokens=total, requests_ahead=ahead))
            started, done_tokens = False, 0
            while not task.done():
                await asyncio.wait({task}, timeout=_POLL_S)
                snap = worker.progress(p.request_id)
                if snap and snap.state == "running":
                    if not started:
                        started = True
                        yield event(started=pb.Started(prompt_tokens=total,
                                                       queue_seconds=time.monotonic() - p.t0))
                    if snap.tokens_done > done_tokens:
                        done_tokens = snap.tokens_done
                        yield event(progress=pb.Progress(tokens_done=done_tokens, prompt_tokens=total))
            result = task.result()
            if not started:
                yield event(started=pb.Started(prompt_tokens=total, queue_seconds=result.timings.queued_s))
            if done_tokens < total:
                yield event(progress=pb.Progress(tokens_done=total, prompt_tokens=total))
            yield event(result=self._response(p, result, request.return_prompt_token_ids))
        finally:
            if not task.done():  # the client went away: cancelling aborts the request in the engine
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    @_unary(pb.ReleaseRequest)
    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        check_request_id(request.request_id)
        return pb.ReleaseResponse(released=self.service.release(request.request_id))

    @_unary(pb.GetServerInfoRequest)
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.ServerInfo:
        i, load = self.service.info, self.service.worker.load()
        return pb.ServerInfo(
            model=i.served_name, model_path=i.path, num_layers=i.num_layers, num_kv_heads=i.num_kv_heads,
            head_dim=i.head_dim, vocab_size=i.vocab_size, max_model_len=i.max_model_len,
            block_size=i.block_size, kv_layout=i.kv_layout, kv_dtype=i.dtype,
            supported_transfer_modes=[self.mode], num_kv_blocks=load.total_blocks,
            num_free_kv_blocks=load.free_blocks, server_version=_package_version(), api_version=API_VERSION,
            versions={"torch": torch.__version__, "grpcio": grpc.__version__,
                      "protobuf": google.protobuf.__version__, "python": sys.version.split()[0]})

    @_unary(pb.ListWorkersRequest)
    async def ListWorkers(self, request: pb.ListWorkersRequest, context) -> pb.ListWorkersResponse:
        status = await asyncio.to_thread(self.service.worker.pool_status)
        workers = []
        for w in status["workers"]:
            s = w.get("stats") or {}
            workers.append(pb.Worker(
                worker=w["worker"], node_ip=s.get("node_ip", ""), pid=s.get("pid", os.getpid()),
                gpu_ids=[str(g) for g in s.get("gpu_ids", [])], outstanding_tokens=w["outstanding_tokens"],
                waiting=s.get("waiting", 0), running=s.get("running", 0), free_kv_blocks=s.get("free_blocks", 0),
                total_kv_blocks=s.get("total_blocks", 0)))
        return pb.ListWorkersResponse(routing=status.get("routing") or "", workers=workers,
                                      replica_states=status.get("replica_states") or {})

    @_unary(pb.ResetPrefixCacheRequest)
    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest, context) -> pb.ResetPrefixCacheResponse:
        # what POST /reset_prefix_cache does (a pool asks every worker: off the event loop); without a
        # prefix cache the worker frees nothing and the call succeeds, as the HTTP route answers "ok"
        freed = await asyncio.to_thread(self.service.worker.reset_prefix_cache)
        return pb.ResetPrefixCacheResponse(reset=True, blocks_freed=freed)


@functools.lru_cache(maxsize=1)
def _package_version() -> str:
    try:
        return importlib.metadata.version("prefill-server")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


# ---- authentication ----

async def _deny(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong API key: send metadata 'authorization: Bearer <key>'",
                        trailing_metadata=(("prefill-error-type", "Unauthenticated"),))


async def _deny_stream(request, context):
    await _deny(request, context)
    yield  # pragma: no cover - abort raises


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <key>`` on prefill.v1 calls; health and reflection stay open
    (load balancers and grpcurl probe them without keys)."""

    def __init__(self, api_keys: ApiKeys):
        self._keys = api_keys
        self._unary = grpc.unary_unary_rpc_method_handler(_deny)
        self._stream = grpc.unary_stream_rpc_method_handler(_deny_stream)

    async def intercept_service(self, continuation, details):
        if details.method.startswith(f"/{SERVICE_NAME}/"):
            got = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
            if self._keys.check(got) is not None:
                return self._stream if details.method.endswith("/PrefillStream") else self._unary
        return await continuation(details)


# ---- assembly ----

class GrpcServer:
    """A started gRPC server: ``port`` is the bound port; ``await stop()`` drains and closes it."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer):
        self.server, self.port, self.health = server, port, health_servicer

    async def set_serving(self, serving: bool) -> None:
        """Follow the decode's health (no effect once shutting down)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Report NOT_SERVING, finish in-flight calls for grace_s, then cancel the rest (freeing their KV)."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def _method_handlers(servicer: PrefillServicer) -> dict[str, grpc.RpcMethodHandler]:
    """Like the generated add_PrefillServiceServicer_to_server, but requests arrive as bytes (parsed
    by the servicer, see _parse)."""
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name["PrefillService"].methods:
        serialize = getattr(pb, m.output_type.name).SerializeToString
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(getattr(servicer, m.name), response_serializer=serialize)
    return handlers


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def start_grpc(service: PrefillService, host: str = "127.0.0.1", port: int = 0, *,
                     api_keys: ApiKeys | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                     tls_client_ca: str | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
                     ) -> GrpcServer:
    """Start prefill.v1.PrefillService + grpc.health.v1 + reflection on host:port in the running loop.

    port 0 picks a free port (GrpcServer.port). TLS when tls_cert and tls_key are given (PEM files);
    tls_client_ca additionally requires client certificates signed by that CA (mutual TLS).
    """
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both --grpc-tls-cert and --grpc-tls-key")
    if tls_client_ca and not tls_cert:
        raise ValueError("--grpc-tls-client-ca needs --grpc-tls-cert and --grpc-tls-key")
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               ("grpc.so_reuseport", 0)]  # a port already in use is an error, not a shared listener
    interceptors = [ApiKeyInterceptor(api_keys)] if api_keys else []
    server = grpc.aio.server(options=options, interceptors=interceptors)
    handlers = _method_handlers(PrefillServicer(service))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server)
    addr = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        if tls_cert:
            creds = grpc.ssl_server_credentials(
                [(_read(tls_key, "--grpc-tls-key"), _read(tls_cert, "--grpc-tls-cert"))],
                root_certificates=_read(tls_client_ca, "--grpc-tls-client-ca") if tls_client_ca else None,
                require_client_auth=bool(tls_client_ca))
            bound = server.add_secure_port(addr, creds)
        else:
            bound = server.add_insecure_port(addr)
    except RuntimeError as e:
        raise OSError(f"gRPC cannot listen on {addr} ({e}); is the port in use?") from None
    if not tls_cert and not _is_loopback(host):
        log.warning("gRPC listens on %s without TLS: requests%s travel in clear; pass --grpc-tls-cert "
                    "and --grpc-tls-key", addr, " and the API key" if api_keys else "")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    return GrpcServer(server, bound, health_servicer)

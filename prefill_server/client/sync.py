"""Blocking client of prefill.v1.PrefillService."""
from __future__ import annotations

from typing import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefill_server.client._common import (DEFAULT_TARGET, ChannelConfig, PrefillEvent, PrefillResult,
                                           PrefillRpcError, build_request, to_event, to_result)
from prefill_server.serving.pb import prefill_pb2 as pb
from prefill_server.serving.pb import prefill_pb2_grpc as pb_grpc


class PrefillClient:
    """``with PrefillClient("host:port", api_key=...) as c: r = c.prefill("Hello")``.

    Each call takes ``timeout`` (seconds; default: the client's); a call that times out or is
    cancelled frees its KV on the server. Failures raise PrefillRpcError. TLS when ``tls=True`` or
    ``root_certificates`` (PEM bytes) are given."""

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, client_cert: bytes | None = None,
                 client_key: bytes | None = None, timeout: float | None = None, options: Sequence = ()):
        self.config = ChannelConfig(target, api_key, tls, root_certificates, client_cert, client_key,
                                    tuple(options))
        creds = self.config.credentials()
        opts = self.config.channel_options()
        self.channel = (grpc.secure_channel(target, creds, opts) if creds
                        else grpc.insecure_channel(target, opts))
        self.stub = pb_grpc.PrefillServiceStub(self.channel)
        self.timeout = timeout

    def __enter__(self) -> "PrefillClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _call(self, method, request, timeout):
        try:
            return method(request, timeout=timeout if timeout is not None else self.timeout,
                          metadata=self.config.metadata())
        except grpc.RpcError as e:
            raise PrefillRpcError.from_rpc_error(e) from None

    def prefill(self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None,
                **kwargs) -> PrefillResult:
        """prompt: text or token ids, or ``messages=[{"role", "content"}, ...]``, or ``chat=`` an OpenAI
        chat request body; other keywords: see ``build_request`` (model, temperature, top_p, top_k,
        seed, request_id, return_prompt_token_ids, add_special_tokens, transfer_mode, cache_salt)."""
        return to_result(self._call(self.stub.Prefill, build_request(prompt, **kwargs), timeout))

    def prefill_stream(self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None,
                       **kwargs) -> Iterator[PrefillEvent]:
        """Yields queued, started, progress..., result. Leaving the loop early cancels the call (and
        the server frees the KV); the result is yielded once the call has ended OK, so it is safe to
        leave the loop right after it."""
        call = self.stub.PrefillStream(build_request(prompt, **kwargs), metadata=self.config.metadata(),
                                       timeout=timeout if timeout is not None else self.timeout)
        result = None
        try:
            for e in call:
                event = to_event(e)
                if event is not None and event.kind == "result":
                    result = event  # held until the stream ends: a cancel before that frees the KV
                elif event is not None:
                    yield event
        except grpc.RpcError as e:
            raise PrefillRpcError.from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once finished
        if result is not None:
            yield result

    def release(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Free the KV held for request_id now; False if nothing was held."""
        return self._call(self.stub.Release, pb.ReleaseRequest(request_id=request_id), timeout).released

    def server_info(self, *, timeout: float | None = None) -> pb.ServerInfo:
        return self._call(self.stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    def list_workers(self, *, timeout: float | None = None) -> pb.ListWorkersResponse:
        """The prefill workers behind the server and their load."""
        return self._call(self.stub.ListWorkers, pb.ListWorkersRequest(), timeout)

    def reset_prefix_cache(self, *, timeout: float | None = None) -> int:
        """Every worker forgets its cached blocks; returns the blocks freed."""
        return self._call(self.stub.ResetPrefixCache, pb.ResetPrefixCacheRequest(), timeout).blocks_freed

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status name ("SERVING", "NOT_SERVING", ...) of service ("" = the server)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        r = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

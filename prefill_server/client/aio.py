"""asyncio client of prefill.v1.PrefillService (grpc.aio); same API as PrefillClient, awaited."""
from __future__ import annotations

from typing import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefill_server.client._common import (DEFAULT_TARGET, ChannelConfig, PrefillEvent, PrefillResult,
                                           PrefillRpcError, build_request, to_event, to_result)
from prefill_server.serving.pb import prefill_pb2 as pb
from prefill_server.serving.pb import prefill_pb2_grpc as pb_grpc


class AsyncPrefillClient:
    """``async with AsyncPrefillClient("host:port") as c: r = await c.prefill("Hello")``.

    Cancelling the awaiting task (or a timeout) cancels the call, and the server frees its KV."""

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, client_cert: bytes | None = None,
                 client_key: bytes | None = None, timeout: float | None = None, options: Sequence = ()):
        self.config = ChannelConfig(target, api_key, tls, root_certificates, client_cert, client_key,
                                    tuple(options))
        creds = self.config.credentials()
        opts = self.config.channel_options()
        self.channel = (grpc.aio.secure_channel(target, creds, opts) if creds
                        else grpc.aio.insecure_channel(target, opts))
        self.stub = pb_grpc.PrefillServiceStub(self.channel)
        self.timeout = timeout

    async def __aenter__(self) -> "AsyncPrefillClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, method, request, timeout):
        try:
            return await method(request, timeout=timeout if timeout is not None else self.timeout,
                                metadata=self.config.metadata())
        except grpc.RpcError as e:
            raise PrefillRpcError.from_rpc_error(e) from None

    async def prefill(self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None,
                      **kwargs) -> PrefillResult:
        return to_result(await self._call(self.stub.Prefill, build_request(prompt, **kwargs), timeout))

    async def prefill_stream(self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None,
                             **kwargs) -> AsyncIterator[PrefillEvent]:
        """Yields queued, started, progress..., result; see PrefillClient.prefill_stream."""
        call = self.stub.PrefillStream(build_request(prompt, **kwargs), metadata=self.config.metadata(),
                                       timeout=timeout if timeout is not None else self.timeout)
        result = None
        try:
            async for e in call:
                event = to_event(e)
                if event is not None and event.kind == "result":
                    result = event
                elif event is not None:
                    yield event
        except grpc.RpcError as e:
            raise PrefillRpcError.from_rpc_error(e) from None
        finally:
            call.cancel()
        if result is not None:
            yield result

    async def release(self, request_id: str, *, timeout: float | None = None) -> bool:
        return (await self._call(self.stub.Release, pb.ReleaseRequest(request_id=request_id), timeout)).released

    async def server_info(self, *, timeout: float | None = None) -> pb.ServerInfo:
        return await self._call(self.stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)

    async def list_workers(self, *, timeout: float | None = None) -> pb.ListWorkersResponse:
        return await self._call(self.stub.ListWorkers, pb.ListWorkersRequest(), timeout)

    async def reset_prefix_cache(self, *, timeout: float | None = None) -> int:
        """Every worker forgets its cached blocks; returns the blocks freed."""
        return (await self._call(self.stub.ResetPrefixCache, pb.ResetPrefixCacheRequest(), timeout)).blocks_freed

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        r = await self._call(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

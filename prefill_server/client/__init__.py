"""Client library of the prefill server's gRPC API (prefill.v1): ``PrefillClient`` (blocking),
``AsyncPrefillClient`` (asyncio), and the prefill-then-decode pipeline helpers."""
from prefill_server.client._common import PrefillEvent, PrefillResult, PrefillRpcError, build_request
from prefill_server.client.aio import AsyncPrefillClient
from prefill_server.client.pipeline import DecodeFailed, astream_completion, decode_request, stream_completion
from prefill_server.client.sync import PrefillClient

__all__ = ["PrefillClient", "AsyncPrefillClient", "PrefillResult", "PrefillEvent", "PrefillRpcError",
           "build_request", "stream_completion", "astream_completion", "decode_request", "DecodeFailed"]

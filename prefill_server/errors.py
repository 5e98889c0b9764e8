"""Typed errors. Caller mistakes subclass ``InvalidRequest`` (HTTP 4xx / gRPC INVALID_ARGUMENT);
the serving layer maps each class to its protocol status. Internal invariants use ``assert``."""
from __future__ import annotations


class PrefillError(Exception):
    """Base class for errors the serving layer turns into a protocol status."""

    http_status = 500
    grpc_code = "INTERNAL"

    def __init__(self, message: str, field: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s  # HTTP Retry-After / gRPC "retry-after" metadata


class InvalidRequest(PrefillError, ValueError):
    """The caller sent something we cannot serve; the message says what to change."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"


class UnknownModel(InvalidRequest):
    http_status = 404
    grpc_code = "INVALID_ARGUMENT"


class PromptTooLong(InvalidRequest):
    http_status = 400
    grpc_code = "INVALID_ARGUMENT"


class PoolExhausted(PrefillError):
    """Not enough free KV blocks came free in time (they are held by running requests and by
    leases that decodes have not read yet): retry later, or give the server a larger pool."""

    http_status = 503
    grpc_code = "RESOURCE_EXHAUSTED"


class Overloaded(PrefillError):
    """More prompt tokens are queued than the engine can start within the queue deadline: shed
    at once (with a Retry-After) rather than time out late."""

    http_status = 429
    grpc_code = "RESOURCE_EXHAUSTED"


class Unauthenticated(PrefillError):
    http_status = 401
    grpc_code = "UNAUTHENTICATED"


class DecodeUnavailable(PrefillError):
    """The decode instance could not be reached or failed; the message names the URL tried."""

    http_status = 502
    grpc_code = "UNAVAILABLE"
    marks_down = True  # the decode is taken out of rotation until its health check passes


class DecodeNotReached(DecodeUnavailable):
    """The connection to the decode failed: the request never reached it (another decode may
    take it with the same KV)."""

    marks_down = False  # (the gateway's retry marks it down itself)


class DecodeFailed(DecodeUnavailable):
    """The decode answered a request with a 5xx: it is up, it failed this request."""

    marks_down = False


class DecodeTimeout(DecodeUnavailable):
    """The decode answered too slowly: its whole answer took longer than --decode-timeout. It is slow,
    not down (other requests still go to it); the request there is closed, so vLLM aborts it."""

    http_status = 504
    grpc_code = "DEADLINE_EXCEEDED"
    marks_down = False


class DecodeDown(DecodeUnavailable):
    """The decode is known to be down (its health check fails): refused before any prefill."""

    http_status = 503


class RequestCancelled(PrefillError):
    http_status = 499
    grpc_code = "CANCELLED"


class TransferError(PrefillError):
    http_status = 502
    grpc_code = "UNAVAILABLE"


class PromptMismatch(PrefillError):
    """The decode answered for a prompt of another length than the one whose KV the prefill made
    (its tokenizer or chat rendering differ from this server's): its answer is withheld."""

    http_status = 502
    grpc_code = "INTERNAL"


class WorkerLost(PrefillError):
    """The prefill worker holding the request died or stopped answering (the pool replaces it):
    retry the request."""

    http_status = 503
    grpc_code = "UNAVAILABLE"


class NoWorker(PrefillError):
    """No prefill worker is running (all starting, or waiting for resources) and none came within
    --max-queue-wait: retry later."""

    http_status = 503
    grpc_code = "UNAVAILABLE"


def error_from(kind: str, message: str, field: str | None = None, retry_after_s: float | None = None) -> PrefillError:
    """A PrefillError rebuilt from its class name (errors cross a process boundary as plain data);
    an unknown name becomes a plain PrefillError (500)."""
    cls = next((c for c in _subclasses(PrefillError) if c.__name__ == kind), PrefillError)
    return cls(message, field=field, retry_after_s=retry_after_s)


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out

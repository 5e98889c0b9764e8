"""API keys for the HTTP and gRPC APIs: ``Authorization: Bearer <key>`` (scheme in any case, as
RFC 9110 says), compared in constant time.

The key comes from ``--api-key-file`` (a file holding it, e.g. a mounted Secret), the
``PREFILL_SERVER_API_KEY`` environment variable, or ``--api-key`` (visible in ``ps``: prefer the
other two). ``/v1/*`` and the gRPC prefill calls need it; ``/metrics`` too with
``--protect-metrics``; ``/health``, ``/livez`` and gRPC health stay open for probes.
"""
from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from prefill_server.errors import Unauthenticated

ENV_VAR = "PREFILL_SERVER_API_KEY"


def load_api_key(key: str | None = None, key_file: str | None = None,
                 environ: dict[str, str] | None = None) -> str | None:
    """The configured key: at most one of --api-key / --api-key-file, else the environment."""
    if key is not None and key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file {key_file}: {e.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {key_file} is empty")
    elif key is None:
        key = (environ if environ is not None else os.environ).get(ENV_VAR) or None
    if key is not None and (not key.strip() or any(c.isspace() for c in key)):
        raise ValueError("the API key must be non-empty and hold no whitespace")
    return key


@dataclass(frozen=True)
class ApiKeys:
    key: str
    protect_metrics: bool = False

    def protects(self, path: str) -> bool:
        return path.startswith("/v1/") or (self.protect_metrics and path == "/metrics")

    def check(self, authorization: str | bytes | None) -> Unauthenticated | None:
        """None if the header carries the key, else the error to answer."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self.key.encode()):
            return None
        return Unauthenticated("missing or wrong API key: send 'Authorization: Bearer <key>'")

"""The request routers Serve made in this process. Serve copies the router class into the process
by value (its module's globals would be copies too), so the pool finds its router's view here."""
from __future__ import annotations

from typing import Any

LIVE: list[Any] = []  # PrefillRouter instances, newest last

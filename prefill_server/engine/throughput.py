"""How many prompt tokens per second the engine computes, measured on its own recent steps.

Admission uses it to tell, when a request arrives, how long the prompt tokens already queued will
take: a request that could not start within the queue deadline is refused at once (429 with a
Retry-After) instead of timing out a minute later. Token-weighted decayed sums, so that a few tiny
steps (overhead only) do not make a large queue look slow.
"""
from __future__ import annotations

import threading


class ThroughputMeter:
    def __init__(self, half_life_steps: float = 20.0, min_seconds: float = 0.05):
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._min_seconds = min_seconds
        self._tokens = 0.0  # decayed sum of tokens computed
        self._seconds = 0.0  # decayed sum of the steps' wall time
        self._measured = 0.0  # undecayed seconds seen, for the evidence threshold
        self._rate: float | None = None  # published: read without a lock (admission, any thread)
        self._lock = threading.Lock()  # (writers)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._tokens = self._tokens * self._decay + tokens
            self._seconds = self._seconds * self._decay + seconds
            self._measured += seconds
            if self._measured >= self._min_seconds:
                self._rate = self._tokens / self._seconds

    def tokens_per_s(self) -> float | None:
        """None until ``min_seconds`` of steps have been measured (the engine's warm-up step
        gives the first measurement before any request arrives)."""
        return self._rate

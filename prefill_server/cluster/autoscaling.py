"""Autoscaling on queued prefill tokens (``--min-workers`` < ``--max-workers``): Ray Serve calls the
policy with each worker's ``queued_tokens`` (``PrefillReplica.record_autoscaling_stats``) and scales
to ceil(total / ``target_tokens``) within the bounds. Serve applies its own up/down-scale delays, and
removes a worker only after draining it (``PrefillReplica.__del__``)."""
from __future__ import annotations

import math
from typing import Any

POLICY = "prefill_server.cluster.autoscaling:QueuedTokensPolicy"


class QueuedTokensPolicy:
    def __init__(self, target_tokens: int = 65536):
        self.target_tokens = target_tokens

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        per_replica = (ctx.aggregated_metrics or {}).get("queued_tokens", {})
        total = sum(per_replica.values())
        want = math.ceil(total / self.target_tokens) if total > 0 else ctx.capacity_adjusted_min_replicas
        return desired(want, ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas), {}


def desired(want: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, want))

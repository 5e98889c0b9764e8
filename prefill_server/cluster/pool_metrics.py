"""``/metrics`` of a pool: the gateway's own families (requests, decodes, first token) and each
worker's engine families with a ``worker`` label, plus each worker's outstanding prompt tokens."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from prefill_server.metrics import escape_label

GATEWAY_FAMILIES = frozenset({"prefill_server:requests", "prefill_server:first_token",
                              "prefill_server:decode_up", "prefill_server:decode_requests_outstanding",
                              "prefill_server:e2e_request_latency_seconds"})


def merge(gateway: bytes, workers: dict[str, bytes], pending_tokens: dict[str, int]) -> bytes:
    """One exposition from the gateway's and the workers' (worker id -> their /metrics text)."""
    families: dict[str, tuple[str, str, list[str]]] = {}  # name -> (type, help, sample lines)

    def add(text: bytes, keep, worker: str | None) -> None:
        for fam in text_string_to_metric_families(text.decode()):
            if not keep(fam.name) or fam.name.endswith("_created"):
                continue
            _, _, lines = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                labels = dict(s.labels) | ({"worker": worker} if worker is not None else {})
                lines.append(f"{s.name}{_labels(labels)} {_value(s.value)}")

    add(gateway, GATEWAY_FAMILIES.__contains__, None)
    for worker, text in sorted(workers.items()):
        add(text, lambda name: name not in GATEWAY_FAMILIES, worker)
    families["prefill_server:worker_pending_tokens"] = (
        "gauge", "Prompt tokens queued or still to compute on the worker (pool)",
        [f"prefill_server:worker_pending_tokens{_labels({'worker': w})} {n}" for w, n in sorted(pending_tokens.items())])
    out = []
    for name, (typ, doc, lines) in families.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {typ}", *lines]
    return ("\n".join(out) + "\n").encode()


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _value(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))

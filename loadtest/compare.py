"""The key numbers of runs side by side, as text and HTML: ``python -m loadtest compare A.json B.json``.

Each run of each file is a column (``file: label @ rate``); with exactly two columns a third gives
B/A. The same rows head ``report``'s HTML.
"""
from __future__ import annotations

import html
import json
import pathlib

# (row name, getter over a run dict, format)
_S = "summary"


def _g(*path):
    def get(run):
        x = run
        for p in path:
            if not isinstance(x, dict):
                return None
            x = x.get(p)
        return x
    return get


ROWS = [
    ("requests", _g(_S, "requests"), "d"),
    ("ok", _g(_S, "ok"), "d"),
    ("errors", _g(_S, "errors"), "d"),
    ("aborted (by the client)", _g(_S, "aborted"), "d"),
    ("duration s", _g(_S, "duration_s"), ".1f"),
    ("offered rate req/s", _g(_S, "offered_rate_rps"), ".3f"),
    ("send lag max s", _g(_S, "send_lag_s", "max"), ".3f"),
    ("throughput req/s", _g(_S, "request_throughput_rps"), ".3f"),
    ("output tok/s", _g(_S, "output_tokens_per_s"), ".1f"),
    ("prompt tok/s", _g(_S, "prompt_tokens_per_s"), ".0f"),
    ("TTFT mean s", _g(_S, "ttft_s", "mean"), ".3f"),
    ("TTFT p50 s", _g(_S, "ttft_s", "p50"), ".3f"),
    ("TTFT p90 s", _g(_S, "ttft_s", "p90"), ".3f"),
    ("TTFT p99 s", _g(_S, "ttft_s", "p99"), ".3f"),
    ("ITL p50 s", _g(_S, "itl_s", "p50"), ".4f"),
    ("ITL p99 s", _g(_S, "itl_s", "p99"), ".4f"),
    ("TPOT p50 s", _g(_S, "tpot_s", "p50"), ".4f"),
    ("E2E p50 s", _g(_S, "e2e_s", "p50"), ".3f"),
    ("E2E p90 s", _g(_S, "e2e_s", "p90"), ".3f"),
    ("E2E p99 s", _g(_S, "e2e_s", "p99"), ".3f"),
    ("goodput req/s", _g(_S, "goodput", "rps"), ".3f"),
    ("goodput share of ok", _g(_S, "goodput", "share_of_ok"), ".2%"),
    ("needle accuracy", _g(_S, "needle", "accuracy"), ".2%"),
    ("429s", _g(_S, "time_to_429_s", "n"), "d"),
    ("time to 429 p99 s", _g(_S, "time_to_429_s", "p99"), ".3f"),
    ("breakdown source", _g("breakdown", "source"), "s"),
    ("queue mean s", _g("breakdown", "queue_s"), ".3f"),
    ("prefill mean s", _g("breakdown", "prefill_s"), ".3f"),
    ("rest of TTFT mean s", _g("breakdown", "to_first_token_s"), ".3f"),
    ("decode mean s", _g("breakdown", "decode_s"), ".3f"),
    ("KV transfer mean s", _g("breakdown", "kv_transfer_s"), ".3f"),
    ("KV blocks in use at end", _g("server", "gauges_at_end", "prefill_server:kv_blocks_in_use"), "g"),
    ("soak verdict", _g("soak", "verdict"), "s"),
]


def fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    try:
        return format(v, spec)
    except (ValueError, TypeError):
        return str(v)


def run_name(run: dict, prefix: str = "") -> str:
    cfg = run.get("config") or {}
    load = (f"@{cfg['rate']:g}/s" if cfg.get("rate") and cfg.get("arrival") in ("poisson", "constant")
            else f"@c{cfg['concurrency']}" if cfg.get("arrival") == "concurrency" and cfg.get("concurrency")
            else f"@{cfg.get('arrival')}" if cfg.get("arrival") else "")
    return f"{prefix}{run.get('label', '?')}{' ' + load if load else ''}"


def columns(docs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(column name, run) for every run of every (name, doc)."""
    cols = []
    for name, doc in docs:
        runs = doc.get("runs") or []
        for run in runs:
            cols.append((run_name(run, f"{name}: " if len(docs) > 1 else ""), run))
    return cols


def table(cols: list[tuple[str, dict]]) -> tuple[list[str], list[list[str]]]:
    header = ["metric"] + [c for c, _ in cols]
    ratio = len(cols) == 2
    if ratio:
        header.append("B/A")
    rows = []
    for name, get, spec in ROWS:
        vals = [get(run) for _, run in cols]
        if all(v is None for v in vals):
            continue
        row = [name] + [fmt(v, spec) for v in vals]
        if ratio:
            a, b = vals
            row.append(f"{b / a:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a
                       and not isinstance(a, bool) else "-")
        rows.append(row)
    return header, rows


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]) + "\n"


def html_table(header: list[str], rows: list[list[str]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


STYLE = ("<style>body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;"
         "margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child,"
         "th:first-child{text-align:left}th{background:#eee}code,pre{background:#f6f6f6}"
         ".pass{color:#070}.fail{color:#b00}</style>")


def load(path: str) -> dict:
    doc = json.loads(pathlib.Path(path).read_text())
    if "runs" not in doc:
        raise ValueError(f"{path}: not a loadtest result (no 'runs')")
    return doc


def compare(paths: list[str], html_out: str | None = None, text_out: str | None = None) -> str:
    docs = [(pathlib.Path(p).stem, load(p)) for p in paths]
    if len({n for n, _ in docs}) < len(docs):
        docs = [(p, d) for p, (_, d) in zip(paths, docs)]
    header, rows = table(columns(docs))
    text = text_table(header, rows)
    if text_out:
        pathlib.Path(text_out).write_text(text)
    if html_out:
        srcs = "".join(f"<li><code>{html.escape(p)}</code>: {html.escape(d.get('command', ''))} "
                       f"({html.escape(d.get('date', ''))})</li>" for p, (_, d) in zip(paths, docs))
        pathlib.Path(html_out).write_text(
            f"<!doctype html><html><head><meta charset='utf-8'><title>loadtest compare</title>{STYLE}</head>"
            f"<body><h1>loadtest compare</h1><ul>{srcs}</ul>{html_table(header, rows)}</body></html>")
    return text

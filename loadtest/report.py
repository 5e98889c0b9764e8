"""The HTML report of a result JSON, with PNG plots written next to it (``NAME.html`` and
``NAME-*.png``; the page opens from disk, without a server). Needs matplotlib (only this module
does: the load generator itself writes JSON without it).

Plots: the TTFT CDF of each run; latency against load when runs differ in rate or concurrency (a
sweep); where the mean request's time went (queue, prefill, the rest of the TTFT, the decode; the
KV transfer beside them: ``breakdown.py``); requests by outcome kind; for a soak run, each request
on a time line with the injected faults (and the server's RSS).
"""
from __future__ import annotations

import html
import json
import pathlib

from loadtest import compare as cmp

PLOTS = ("ttft_cdf", "latency_vs_load", "breakdown", "errors", "soak_timeline")


def _plt():
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("the HTML report needs matplotlib (pip install matplotlib); the JSON is complete "
                           "without it") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load_x(run: dict) -> tuple[str, float | None]:
    cfg = run.get("config") or {}
    if cfg.get("arrival") == "concurrency":
        return "concurrency (requests in flight)", cfg.get("concurrency")
    if cfg.get("rate"):
        return "offered rate (requests/s)", cfg["rate"]
    return "offered rate (requests/s)", (run.get("summary") or {}).get("offered_rate_rps")


def plot_ttft_cdf(plt, runs, path) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    any_data = False
    for run in runs:
        xs = sorted(r["ttft_s"] for r in run["records"] if r.get("status") == "ok" and r.get("ttft_s") is not None)
        if xs:
            any_data = True
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=cmp.run_name(run))
    if not any_data:
        ax.text(0.5, 0.5, "no successful request", ha="center", transform=ax.transAxes)
    else:
        xs_all = [x for line in ax.get_lines() for x in line.get_xdata() if x > 0]
        if xs_all and max(xs_all) / min(xs_all) > 50:
            ax.set_xscale("log")  # a wide range (queueing): log scale keeps the fast ones visible
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of successful requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    if any_data:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_latency_vs_load(plt, runs, path) -> bool:
    by_label: dict[str, list] = {}
    xlabel = None
    for run in runs:
        xlabel, x = _load_x(run)
        if x is not None:
            by_label.setdefault(run.get("label", "?"), []).append((x, run["summary"]))
    if not any(len({x for x, _ in pts}) > 1 for pts in by_label.values()):
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, pts in by_label.items():
        pts.sort(key=lambda p: p[0])
        xs = [p[0] for p in pts]
        for key, ax in (("ttft_s", axes[0]), ("e2e_s", axes[1])):
            for q, style in (("p50", "-o"), ("p99", "--^")):
                ys = [p[1][key][q] for p in pts]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style, label=f"{label} {q}")
    for ax, name in ((axes[0], "TTFT"), (axes[1], "E2E latency")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{name} (s)")
        ax.set_title(f"{name} vs load")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


_SEGMENTS = (("queue_s", "queue", "#9ecae1"), ("prefill_s", "prefill", "#3182bd"),
             ("to_first_token_s", "rest of the TTFT (tokenizing, HTTP, KV pull, the decode's first step)", "#fdae6b"),
             ("decode_s", "decode (the other tokens)", "#bdbdbd"))


def plot_breakdown(plt, runs, path) -> bool:
    """One stacked bar per run (mean seconds per request, ``breakdown.compute``); the KV transfer
    beside it, hatched: it overlaps the rest of the TTFT and the decode."""
    keys = [k for k, _, _ in _SEGMENTS] + ["kv_transfer_s"]
    rows = [(cmp.run_name(run), b) for run in runs if (b := run.get("breakdown")) and any(b.get(k) for k in keys)]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows) + 3), 4.6))
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for key, label, color in _SEGMENTS:
        vals = [b.get(key) or 0.0 for _, b in rows]
        if any(vals):
            ax.bar([x - 0.18 for x in xs], vals, 0.36, bottom=bottom, label=label, color=color)
            bottom = [lo + v for lo, v in zip(bottom, vals)]
    kv = [b.get("kv_transfer_s") or 0.0 for _, b in rows]
    if any(kv):
        ax.bar([x + 0.2 for x in xs], kv, 0.3, label="KV transfer (overlaps the two above it)", color="#74c476",
               hatch="//")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{name}\n({b['source']})" for name, b in rows], rotation=10, fontsize=8)
    ax.set_ylabel("mean seconds per successful request")
    ax.set_title("where the time went")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_errors(plt, runs, path) -> bool:
    kinds = sorted({k for run in runs for k in run["summary"]["by_kind"]})
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(kinds) + 3), 4.2))
    width = 0.8 / max(1, len(runs))
    for j, run in enumerate(runs):
        vals = [run["summary"]["by_kind"].get(k, 0) for k in kinds]
        ax.bar([i + j * width for i in range(len(kinds))], vals, width, label=cmp.run_name(run))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(kinds))])
    ax.set_xticklabels(kinds, rotation=20, fontsize=8)
    ax.set_ylabel("requests")
    ax.set_title("requests by outcome kind")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_soak_timeline(plt, runs, path) -> bool:
    run = next((r for r in runs if r.get("soak")), None)
    if run is None:
        return False
    soak = run["soak"]
    fig, ax = plt.subplots(figsize=(10, 4.4))
    kinds = sorted({r.get("status") or "unknown" for r in run["records"]})
    for k in kinds:
        pts = [(r["sent_s"], (r.get("end_s") or r["sent_s"]) - r["sent_s"]) for r in run["records"]
               if (r.get("status") or "unknown") == k and r.get("sent_s") is not None]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, label=k)
    end = run.get("duration_s") or 1.0
    for i, (a, b) in enumerate(soak.get("fault_windows_s") or []):
        ax.axvspan(a, min(b, end), color="red", alpha=0.12, label="fault window" if i == 0 else None)
    for inj in soak.get("injections") or []:
        if inj.get("ran"):
            ax.axvline(inj["started_s"], color="red", lw=1)
    ax.set_xlim(0, end)
    ax.set_xlabel("sent at (s into the run)")
    ax.set_ylabel("request duration (s)")
    ax.set_title(f"soak: requests and injected faults (verdict: {soak.get('verdict')})")
    ax.grid(alpha=0.3)
    if soak.get("rss_samples_mb"):
        ax2 = ax.twinx()
        ax2.plot([t for t, _ in soak["rss_samples_mb"]], [m for _, m in soak["rss_samples_mb"]], "k-", lw=1,
                 label="server RSS (MiB)")
        ax2.set_ylabel("server RSS (MiB)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(doc: dict, html_path: str) -> dict[str, str]:
    """Write the HTML and its PNGs; returns {plot name: PNG path}."""
    plt = _plt()
    out = pathlib.Path(html_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = doc.get("runs") or []
    pngs = {}
    for name in PLOTS:
        p = out.with_name(f"{out.stem}-{name}.png")
        if globals()[f"plot_{name}"](plt, runs, p):
            pngs[name] = str(p)
    out.write_text(_html(doc, runs, {k: pathlib.Path(v).name for k, v in pngs.items()}))
    return pngs


def _html(doc: dict, runs: list[dict], pngs: dict[str, str]) -> str:
    e = html.escape
    header, rows = cmp.table(cmp.columns([("", doc)]))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>loadtest {e(doc.get('mode', ''))}"
             f"</title>{cmp.STYLE}</head><body>",
             f"<h1>loadtest {e(doc.get('mode', ''))}: {e(', '.join(sorted({r.get('label', '?') for r in runs})))}</h1>",
             f"<p>{e(doc.get('date', ''))}<br><code>{e(doc.get('command', ''))}</code></p>",
             "<h2>Key numbers</h2>", cmp.html_table(header, rows)]
    slo = (runs[0]["summary"].get("slo") if runs else None) or {}
    parts.append(f"<p>Goodput SLOs: TTFT &le; {e(str(slo.get('ttft_s')))} s, ITL ({e(str(slo.get('itl_stat')))})"
                 f" &le; {e(str(slo.get('itl_s')))} s (None: not applied).</p>")
    for run in runs:
        if run.get("soak"):
            parts.append(_soak_html(run["soak"]))
    titles = {"ttft_cdf": "TTFT CDF", "latency_vs_load": "Latency vs load",
              "breakdown": "Where the time went", "errors": "Outcomes", "soak_timeline": "Soak time line"}
    for name, file in pngs.items():
        parts.append(f"<h2>{titles[name]}</h2><img src='{e(file)}' alt='{e(name)}'>")
    parts.append("<h2>Errors by kind, HTTP statuses, server counters</h2>")
    for run in runs:
        s = run["summary"]
        server = run.get("server") or {}
        examples = {}
        for r in run["records"]:
            if r.get("status") not in ("ok", None) and r["status"] not in examples:
                examples[r["status"]] = r.get("error") or ""
        parts.append(f"<h3>{e(cmp.run_name(run))}</h3><p>by kind: <code>{e(json.dumps(s['by_kind']))}</code>"
                     f"<br>by HTTP status: <code>{e(json.dumps(s['by_http_status']))}</code>"
                     f"<br>server counters (deltas): <code>{e(json.dumps(server.get('counters') or {}))}</code>"
                     f"<br>server gauges at the end: <code>{e(json.dumps(server.get('gauges_at_end') or {}))}</code>"
                     + (f"<br>metrics: {e(server['scrape_error'])}" if server.get("scrape_error") else "") + "</p>")
        if examples:
            parts.append("<ul>" + "".join(f"<li><b>{e(k)}</b>: {e(v[:300])}</li>" for k, v in examples.items())
                         + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _soak_html(soak: dict) -> str:
    e = html.escape
    rows = "".join(f"<tr><td>{e(k)}</td><td class='{'pass' if v['pass'] else 'fail' if v['pass'] is False else ''}'>"
                   f"{e({True: 'pass', False: 'FAIL', None: 'not measured'}[v['pass']])}</td>"
                   f"<td style='text-align:left'>{e(v.get('detail', ''))}</td></tr>"
                   for k, v in soak["invariants"].items())
    inj = "".join(f"<li>at {i['at_s']:g} s: <code>{e(i['command'])}</code> rc={e(str(i.get('rc')))}</li>"
                  for i in soak.get("injections") or [])
    return (f"<h2>Soak verdict: <span class='{soak['verdict']}'>{e(soak['verdict'].upper())}</span></h2>"
            f"<table><tr><th>invariant</th><th>result</th><th>detail</th></tr>{rows}</table>"
            + (f"<p>Injections:</p><ul>{inj}</ul>" if inj else ""))

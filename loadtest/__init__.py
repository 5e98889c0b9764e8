"""A load generator for the prefill server (and any OpenAI-compatible server), driven only through
its public APIs: HTTP (OpenAI ``/v1/completions``, ``/v1/chat/completions``, ``/metrics``) and gRPC
(``prefill_server.client``). Nothing else of the server is imported (``tests/loadtest`` checks it).

    python -m loadtest run   --url http://127.0.0.1:8000 --workload rag --rate 2 --count 100 --out run.json
    python -m loadtest sweep --url ... --rates 0.5,1,2,4 --duration 60 --out sweep.json --html sweep.html
    python -m loadtest soak  --url ... --duration 1800 --inject 300:'./restart-decode.sh' --out soak.json
    python -m loadtest compare a.json b.json --html cmp.html
    python -m loadtest report run.json --html run.html

Modules: ``text`` (offline text, token lengths), ``workloads`` (the request generators),
``arrival`` (when requests are sent), ``client`` (one request over HTTP or gRPC, its timings and
error kind), ``runner`` (the asyncio driver), ``progress`` (its live counters and bar),
``promscrape`` (``/metrics`` deltas), ``stats`` (percentiles, goodput), ``breakdown`` (where the
time went), ``soak`` (fault injection and invariants), ``drain`` (SIGTERM under load), ``report``
and ``compare`` (HTML/PNG/text), ``cli``. The user's guide: ``docs/loadtest.md``.
"""

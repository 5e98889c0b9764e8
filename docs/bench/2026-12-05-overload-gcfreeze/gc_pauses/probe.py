"""Every cyclic-collection pause of a running prefill-server (gc.callbacks), summed up every 20 s on
stderr: per generation (count, max ms, mean ms), the last pauses over 2 ms, the tracked objects.
Run like the CLI: .venv/bin/python docs/bench/2026-12-05-overload-gcfreeze/gc_pauses/probe.py serve --transfer-mode local --port 8123 --dtype float32"""
import gc, sys, time, threading, json
pauses = []
t0 = {}
def cb(phase, info):
    if phase == "start":
        t0['t'] = time.perf_counter()
    else:
        pauses.append((info["generation"], (time.perf_counter() - t0['t']) * 1e3, info["collected"]))
gc.callbacks.append(cb)
def report():
    while True:
        time.sleep(20)
        big = [p for p in pauses if p[1] > 2]
        by = {}
        for g, ms, _ in pauses:
            by.setdefault(g, []).append(ms)
        print("GC", {g: (len(v), round(max(v), 1), round(sum(v)/len(v), 2)) for g, v in by.items()}, "over2ms", [(g, round(ms,1)) for g, ms, _ in big[-10:]], "counts", gc.get_count(), "objects", len(gc.get_objects()), file=sys.stderr, flush=True)
threading.Thread(target=report, daemon=True).start()
from prefill_server.cli import main
sys.argv = ["prefill-server"] + sys.argv[1:]
main()

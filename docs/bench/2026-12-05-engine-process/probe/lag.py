"""Event-loop lag inside the server (an asyncio task sleeping 5 ms) while it serves; dumped to
/tmp/engine-process-probe/lags.json after LAG_SECONDS."""
import asyncio, sys, time, threading, json, os
from prefill_server.cli import main

lags = []
def install():
    async def probe():
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append((t, time.perf_counter() - t - 0.005))
    loop = asyncio.get_event_loop()
    loop.create_task(probe())
orig_run = asyncio.run
def run(coro, **kw):
    async def wrapped():
        install()
        return await coro
    return orig_run(wrapped(), **kw)
if __name__ == "__main__":
    asyncio.run = run
def dump():
    time.sleep(float(os.environ.get("LAG_SECONDS", "150")))
    json.dump(lags, open("/tmp/engine-process-probe/lags.json", "w"))
    print("dumped", len(lags), file=sys.stderr, flush=True)
if __name__ == "__main__":
    threading.Thread(target=dump, daemon=True).start()
    sys.argv = ["prefill-server"] + sys.argv[1:]
    main()

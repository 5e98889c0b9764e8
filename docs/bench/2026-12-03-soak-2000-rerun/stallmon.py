import time, json, sys
out = open(sys.argv[1], "a")
last = time.monotonic(); lastw = time.time()
while True:
    time.sleep(0.1)
    now = time.monotonic()
    if now - last > 1.0:
        out.write(json.dumps({"at": time.strftime("%H:%M:%S", time.gmtime(lastw)), "gap_s": round(now - last, 2)}) + "\n"); out.flush()
    last = now; lastw = time.time()

import time
last = time.monotonic()
with open("monitor.log", "a") as f:
    while True:
        time.sleep(0.01)
        now = time.monotonic()
        if now - last > 0.2:
            f.write(f"{time.strftime('%T')} gap {now-last:.2f}\n"); f.flush()
        last = now

"""An external reference: a process that sleeps 5 ms at a time and records how late it wakes."""
import time, json, sys
gaps = []; end = time.perf_counter() + float(sys.argv[1])
last = time.perf_counter()
while last < end:
    time.sleep(0.005); now = time.perf_counter(); gaps.append((last, now - last - 0.005)); last = now
json.dump(gaps, open("/tmp/engine-process-probe/ext.json", "w"))

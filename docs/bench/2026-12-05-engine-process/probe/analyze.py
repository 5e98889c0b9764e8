"""Event-loop lags (lag.py) over 10-50 ms, and those the external sleeper (ext.py) did not also have."""
import json, bisect
lags = json.load(open('/tmp/engine-process-probe/lags.json')); ext = json.load(open('/tmp/engine-process-probe/ext.json'))
t0, t1 = ext[0][0], ext[-1][0]
lags = [(t, l) for t, l in lags if t0 <= t <= t1]
et = [t for t, _ in ext]
def ext_gap(a, b):
    i = bisect.bisect_left(et, a - 0.1); m = 0
    while i < len(ext) and ext[i][0] < b:
        m = max(m, ext[i][1]); i += 1
    return m
for thr in (0.01, 0.02, 0.03, 0.05):
    big = [(t, l) for t, l in lags if l > thr]
    unexplained = [(t, l) for t, l in big if ext_gap(t, t + l + 0.005) < l / 2]
    print(f"loop lag > {thr*1e3:.0f} ms: {len(big)} of {len(lags)}; external sleeper not also late: {len(unexplained)}; max {max([l for _,l in big], default=0)*1e3:.1f}", [round(l*1e3) for _, l in unexplained][:20])
e = sorted(l for _, l in ext); L = sorted(l for _, l in lags)
q = lambda a, p: a[int(p * (len(a) - 1))] * 1e3
print("loop p50/p99/p99.9/max ms", [round(q(L, p), 2) for p in (0.5, 0.99, 0.999, 1)])
print("ext  p50/p99/p99.9/max ms", [round(q(e, p), 2) for p in (0.5, 0.99, 0.999, 1)])

"""The issue-17 bench (docs/bench/2026-12-03-prefix-cache-h200/bench.py) as it is, plus the graph
counters of every runner it builds (captures, replays, failures), written next to its result.

    python3 docs/bench/2026-12-03-prefix-cache-graphs/bench_graphs.py --out $OUT/bench.json [bench.py's options]
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-12-03-prefix-cache-h200"))

from prefill_server.engine import graphs  # noqa: E402

INSTANCES = []
_init = graphs.StepGraphs.__init__


def _recording_init(self, *a, **kw):
    _init(self, *a, **kw)
    INSTANCES.append(self.stats)  # (the dict only: the runner and its pool are freed as bench.py means)


graphs.StepGraphs.__init__ = _recording_init

import bench  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    bench.main(argv)
    out = argv[argv.index("--out") + 1] if "--out" in argv else "result.json"
    rows = [dict(st) for st in INSTANCES]
    with open(os.path.splitext(out)[0] + "_graph_stats.json", "w") as f:
        json.dump({"env_PREFILL_CUDA_GRAPHS": os.environ.get("PREFILL_CUDA_GRAPHS"), "runners": rows}, f, indent=1)
    print("graph stats per runner (order of bench's runs):", json.dumps(rows))

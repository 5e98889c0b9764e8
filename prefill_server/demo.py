"""`prefill-server demo`: the whole pipeline on this machine, as a new user first sees it.

1. converts the embedded SmolLM2-135M-Instruct (once), 2. starts a real vLLM decode from
``.venv-vllm`` (stock NixlConnector consumer), 3. starts ``prefill-server serve`` in front of it,
4. sends one warm-up request through each, then one chat request through the prefill server and the
same request to vLLM alone, prints both answers (with their times: both warm) and whether they
are identical, 5. stops everything.
"""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import time

import httpx

from prefill_server.local_vllm import VllmDecode, vllm_python
from prefill_server.models.registry import cache_dir, resolve_model


def _start_server(decode: VllmDecode, dtype: str, log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    exe = pathlib.Path(sys.executable).parent / "prefill-server"
    cmd = [str(exe), "serve", "--model", decode.model, "--port", "0", "--decode-url", decode.url,
           "--transfer-mode", "nixl-compat", "--dtype", dtype, "--kv-cache-gib", "0.25"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on (http://\S+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"prefill-server did not start; see {log}:\n{log.read_text()[-3000:]}")
    return proc, m.group(1)


def _chat(url: str, prompt: str) -> tuple[str, float]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 48, "temperature": 0}
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"], time.monotonic() - t0


def run_demo(prompt: str, dtype: str = "float32") -> int:
    if vllm_python() is None:
        print("error: no vLLM decode environment at .venv-vllm; run: bash scripts/setup.sh", file=sys.stderr)
        return 2
    logs = cache_dir() / "demo"
    logs.mkdir(parents=True, exist_ok=True)
    model = resolve_model(None)
    print(f"model: {model}")
    print("starting the vLLM decode (1-3 minutes on a small CPU machine) ...", flush=True)
    with VllmDecode(model=str(model), log_path=logs / "vllm-decode.log", dtype=dtype, block_size=32) as decode:
        decode.completion("Warm up.", max_tokens=2)
        print(f"vLLM decode ready at {decode.url}; starting prefill-server ...", flush=True)
        server, url = _start_server(decode, dtype, logs / "prefill-server.log")
        try:
            print(f"prefill-server ready at {url}; one warm-up request through it ...", flush=True)
            _chat(url, "Warm up.")  # the first request through each pays one-time costs: time warm ones
            print(f"\nuser: {prompt}")
            ours, t_ours = _chat(url, prompt)
            alone, t_alone = _chat(decode.url, prompt)
            print(f"\nassistant (prefill-server -> vLLM decode, {t_ours:.2f} s, warm):\n{ours}")
            print(f"\nassistant (vLLM alone, {t_alone:.2f} s, warm):\n{alone}")
            same = ours == alone
            print(f"\nidentical: {'yes' if same else 'NO'}")
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            used = re.search(r"^prefill_server:kv_blocks_in_use (\S+)$", metrics, re.M)
            print(f"prefill KV blocks still in use: {used.group(1) if used else '?'}; logs in {logs}")
            return 0 if same else 1
        finally:
            server.terminate()
            server.wait(timeout=30)

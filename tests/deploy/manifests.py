"""Shared by the tests in tests/deploy (a helper module, not a test file): the repo's paths,
deploy/k8s rendered with ``kubectl kustomize`` (skipped where kubectl is absent), and lookups in
the rendered objects."""
from __future__ import annotations

import functools
import pathlib
import shutil
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
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


def port_of(container: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name_or_number)


def prestop_seconds(container: dict) -> float:
    cmd = container["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep", cmd
    return float(cmd[1])

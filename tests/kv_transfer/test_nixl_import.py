"""``import_nixl`` without NIXL's ``nixl`` meta package: ``pip install prefill-server`` brings the
``nixl-cu12`` build alone (the meta package requires every CUDA build), and the default transfer
mode must still start. Run in a child process, so the import state of this one is left alone."""
import subprocess
import sys

CODE = """
import sys
sys.modules["nixl"] = None  # as if the meta package were not installed
from kv_transfer.nixl import import_nixl
api = import_nixl()
agent = api.nixl_agent("t", api.nixl_agent_config(backends=["UCX"]))
print(api.__name__)
"""


def test_the_installed_build_serves_without_the_meta_package():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] in ("nixl_cu12._api", "nixl_cu13._api")

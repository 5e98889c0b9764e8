"""The load generator drives the server only through its public APIs: of the server's packages it may
import ``prefill_server.client`` (the gRPC client library) and nothing else."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVER_PACKAGES = ("prefill_server", "kv_transfer")
ALLOWED = "prefill_server.client"


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import at any depth (lazy ones too); relative imports are
    within loadtest."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            out.append((node.lineno, str(node.args[0].value)))
    return out


def test_loadtest_imports_nothing_of_the_server_but_its_client():
    files = sorted((ROOT / "loadtest").rglob("*.py"))
    assert len(files) >= 10
    bad = []
    for f in files:
        for line, mod in imported_modules(f):
            top = mod.split(".")[0]
            if top in SERVER_PACKAGES and not (mod == ALLOWED or mod.startswith(ALLOWED + ".")):
                if mod.rpartition(".")[0] == ALLOWED.rpartition(".")[0] and mod.rpartition(".")[2] == "client":
                    continue  # "from prefill_server import client"
                bad.append(f"{f.relative_to(ROOT)}:{line}: {mod}")
    assert bad == [], "loadtest must reach the server only over HTTP and gRPC (prefill_server.client):\n" + \
        "\n".join(bad)


def test_the_rule_sees_imports_at_any_depth(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from prefill_server.serving import http\n    import kv_transfer.base\n")
    mods = {m for _, m in imported_modules(f)}
    assert {"prefill_server.serving", "kv_transfer.base"} <= mods

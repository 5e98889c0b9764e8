"""The seams, checked on the source: serving reaches the engine only through the worker interface,
the decode-side connector imports nothing of the prefill side, no import cycle, no source file so
long that it should be split (unless it says at its top why not)."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("prefill_server", "kv_transfer", "loadtest")
MAX_LINES = 500
LONG_FILE_MARKER = "Why this file is long:"  # within its first 40 lines, then the reason


def module_files() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py") if (ROOT / pkg).is_dir() else ():
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Our modules that ``name`` imports, at any depth of its code (lazy imports count too)."""
    out = set()
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def graph(with_parents: bool = False) -> dict[str, set[str]]:
    """Module -> our modules it imports (``typing.TYPE_CHECKING`` blocks excluded). with_parents:
    also the packages whose ``__init__`` runs first (what importing a module loads)."""
    files = module_files()
    known = set(files)
    g = {n: imports_of(n, f, known) for n, f in files.items()}
    if with_parents:
        for n in list(g):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            parts = n.split(".")
            g[n] |= {".".join(parts[:i]) for i in range(1, len(parts))} & known
    return g


def closure(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(g.get(n, ()))
    return seen


def test_serving_reaches_the_engine_only_through_the_worker_interface():
    g = graph()
    bad = {(n, dep) for n in g if n.startswith("prefill_server.serving")
           for dep in g[n] if dep.startswith("prefill_server.engine") and dep not in ("prefill_server.engine",
                                                                                      "prefill_server.engine.worker")}
    assert bad == set(), f"serving modules import engine internals: {sorted(bad)}"


def test_the_decode_side_connector_imports_nothing_of_the_prefill_side():
    deps = closure(graph(with_parents=True), "kv_transfer.vllm.connector")
    prefill_side = sorted(d for d in deps if d.startswith("prefill_server") or d in (
        "kv_transfer.push", "kv_transfer.pull", "kv_transfer.base", "kv_transfer.vllm.v0_32",
        "kv_transfer.vllm.v0_33", "kv_transfer.vllm.nixl_wire", "kv_transfer.vllm.nixl_decode",
        "kv_transfer.vllm.nixl_versions", "kv_transfer.vllm.nixl_compat"))
    assert prefill_side == [], f"kv_transfer.vllm.connector pulls in {prefill_side}"


def test_no_import_cycles():
    g = graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    # a package importing its own submodules (an __init__ re-export) is not a cycle of meaning
    cycles = [c for c in cycles if not all(x.startswith(min(c, key=len)) for x in c)]
    assert cycles == [], f"import cycles: {cycles}"


def test_no_source_file_too_long_without_a_reason():
    long = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "pb" in rel.parts or rel.parts[0] == "build":
            continue
        lines = f.read_text().splitlines()
        if len(lines) > MAX_LINES and not any(LONG_FILE_MARKER in line for line in lines[:40]):
            long.append(f"{rel} ({len(lines)} lines)")
    assert long == [], f"split these, or say at their top '{LONG_FILE_MARKER} ...': {long}"

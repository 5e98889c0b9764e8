"""Every relative path the README and the docs name exists, and no link leaves the repository."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE_SPAN = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATHLIKE = re.compile(r"[\w.-]+(/[\w.*-]+)+/?")
GENERATED = (".venv", ".venv-vllm", ".cache", "build", "dist")  # made by set-up or at run time
OTHER_PROJECTS = ("vllm", "sglang", "nixl", "torch", "triton")  # their own source trees, cited as such


def named_paths(text: str) -> set[str]:
    found = set()
    for m in CODE_SPAN.finditer(text):
        token = m.group(1).rstrip(".,;:")
        if PATHLIKE.fullmatch(token) and not token.startswith(("/", "~")):
            found.add(token)
    for m in LINK.finditer(text):
        found.add(m.group(1).split("#")[0])
    return found


def exists(path: str) -> bool:
    if path.split("/")[0] in GENERATED + OTHER_PROJECTS:
        return True
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def test_every_relative_path_named_in_the_docs_exists():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for path in sorted(named_paths(text)):
            if path.startswith(("http://", "https://")):
                continue
            candidates = [path, str((doc.parent / path).relative_to(ROOT)) if not path.startswith("..") else path]
            if not any(exists(c) for c in candidates):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert missing == [], "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_no_link_leaves_the_repository():
    outside = [f"{doc.relative_to(ROOT)}: {p}" for doc in DOCS for p in named_paths(doc.read_text())
               if p.startswith("../") or "/shared/" in p]
    assert outside == [], outside

"""A failed pool test carries the tail of its server's log (the gateway's, with Ray's controller and
the workers' lines forwarded into it): a failure seen only on CI can be read there."""
from __future__ import annotations

import pathlib

import pytest

LOG_LINES = 150


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    log: pathlib.Path | None = getattr(item.module, "SERVER_LOG", None)
    if rep.failed and log is not None and log.exists():
        lines = log.read_text(errors="replace").splitlines()[-LOG_LINES:]
        rep.sections.append((f"server log, last {len(lines)} lines ({log})", "\n".join(lines)))

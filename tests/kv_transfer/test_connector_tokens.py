"""How many prompt tokens our vLLM connector loads from the prefill server: its scheduler side run
on vLLM's own Request / KVCacheBlocks (``connector_scheduler.py`` in .venv-vllm, where vLLM
imports; skipped without it). The transfers themselves: test_push.py, test_pull.py,
test_pull_later.py and tests/e2e."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from kv_transfer import wire
from kv_transfer.wire import PARAMS_KEY

REPO = pathlib.Path(__file__).resolve().parents[2]
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
SCRIPT = pathlib.Path(__file__).with_name("connector_scheduler.py")


def params(**extra) -> dict:
    return {PARAMS_KEY: {"version": wire.PROTOCOL_VERSION, "request_id": "pf-1", "host": "127.0.0.1",
                         "port": 5555, **extra}}


# (name, prompt length, tokens vLLM has computed / cached locally, kv_transfer_params,
#  expected (matched, is_async), expected receive (first_token, num_tokens, mode) or None)
CASES = [
    # computed first: the decode's prompt is the prefill's 40 tokens + its first token; vLLM
    # computes that last position itself
    ("prompt + first token", 41, 0, params(num_tokens=40, transfer_mode="pull"), (40, True), (0, 40, "pull")),
    # the gateway's fallback: the original prompt with the same params (vLLM recomputes the last)
    ("original prompt", 40, 0, params(num_tokens=40, transfer_mode="pull"), (40, True), (0, 40, "pull")),
    ("prefix cached locally", 41, 16, params(num_tokens=40, transfer_mode="pull"), (24, True), (16, 40, "pull")),
    ("all cached locally", 41, 48, params(num_tokens=40, transfer_mode="pull"), (0, False), None),
    ("push, as today", 40, 0, params(num_tokens=40), (40, True), (0, 40, "push")),
    ("no num_tokens: the whole prompt", 41, 0, params(transfer_mode="pull"), (41, True), (0, 41, "pull")),
    ("num_tokens past the prompt", 30, 0, params(num_tokens=40), (30, True), (0, 30, "push")),
    ("num_tokens 0: malformed", 41, 0, params(num_tokens=0), (0, False), None),
    ("num_tokens negative: malformed", 41, 0, params(num_tokens=-3), (0, False), None),
    ("num_tokens a string: malformed", 41, 0, params(num_tokens="40"), (0, False), None),
    ("num_tokens a bool: malformed", 41, 0, params(num_tokens=True), (0, False), None),
    ("num_tokens a float: malformed", 41, 0, params(num_tokens=40.0), (0, False), None),
    ("not ours", 41, 0, {"other": {}}, (0, False), None),
]


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    if not VLLM_PY.exists():
        pytest.skip("no .venv-vllm (scripts/setup.sh makes it): the connector imports vLLM")
    cases = [{"prompt_len": n, "num_computed": c, "params": p} for _, n, c, p, _, _ in CASES]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's connector, not an installed copy
    out = subprocess.run([str(VLLM_PY), str(SCRIPT)], input=json.dumps(cases).encode(), capture_output=True,
                         timeout=300, cwd=str(REPO), env=env)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_connector_loads_the_prefills_num_tokens(outcomes, i):
    _, _, _, _, matched, receive = CASES[i]
    got = outcomes[i]
    assert (got["matched"], got["is_async"]) == matched
    if receive is None:
        assert got["receive"] is None
    else:
        r = got["receive"]
        assert (r["first_token"], r["num_tokens"], r["mode"]) == receive

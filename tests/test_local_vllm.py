"""The local decode launcher's CPU placement (the demo's and the e2e tests' vLLM decode)."""
from __future__ import annotations

import os
import pathlib

from prefill_server.local_vllm import VllmDecode, last_cpu


def test_decode_computes_on_the_last_allowed_cpu():
    # The core NixlConnector's CPU worker reserves for transfers: with the decode's thread on core 0
    # a 2-core VM froze for seconds under P/D traffic (docs/bench/2026-12-06-nixl-cpu-stalls).
    allowed = os.sched_getaffinity(0)
    assert last_cpu() == max(allowed)
    env = VllmDecode(model="m", log_path=pathlib.Path("/dev/null")).environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(max(allowed))


def test_an_explicit_binding_is_kept():
    env = VllmDecode(model="m", log_path=pathlib.Path("/dev/null"), omp_threads_bind="0-1").environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"

#!/usr/bin/env bash
# The default test run: set-up (idempotent), then every test that needs no GPU and no running vLLM.
#   bash scripts/test.sh            unit, model-numerics, engine, serving, gRPC, transfer, kernel tests
#   bash scripts/test.sh --e2e      also the end-to-end tests against a real vLLM decode (tests/e2e)
# Extra pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
if [ "${1:-}" = "--e2e" ]; then
  shift
  export PREFILL_E2E_REQUIRED=${PREFILL_E2E_REQUIRED:-1}
  exec .venv/bin/python -m pytest -ra -m "not slow and not gpu" "$@"
fi
# The NIXL tests (and the prefill instance's, which serves a real NIXL side channel) run in their
# own process: in one long session, loading NIXL's UCX libraries
# after Triton's interpreter tests aborted the interpreter once (not understood yet; see issue notes).
M="not slow and not gpu and not e2e"
.venv/bin/python -m pytest -ra -m "$M" tests/kv_transfer tests/serving/test_prefill_instance.py "$@"
# The pool's tests start local Ray clusters (and fake GPUs): their own process too.
.venv/bin/python -m pytest -ra -m "$M" tests/cluster "$@"
exec .venv/bin/python -m pytest -ra -m "$M" --ignore=tests/kv_transfer --ignore=tests/cluster \
  --ignore=tests/serving/test_prefill_instance.py "$@"

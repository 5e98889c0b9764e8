#!/usr/bin/env bash
# The default test run: set-up (idempotent), then every test that needs no GPU and no running vLLM.
#   bash scripts/test.sh            unit, model-numerics, engine, serving, gRPC, transfer, kernel tests
#   bash scripts/test.sh --e2e      also the end-to-end tests against a real vLLM decode (tests/e2e)
# Extra pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1 PYTHONUNBUFFERED=1
M="not slow and not gpu and not e2e"
if [ "${1:-}" = "--e2e" ]; then
  shift
  export PREFILL_E2E_REQUIRED=${PREFILL_E2E_REQUIRED:-1}
  # with arguments (paths, options): one run of those; without: the three runs below, e2e tests included
  [ $# -gt 0 ] && exec .venv/bin/python -m pytest -ra -m "not slow and not gpu" "$@"
  M="not slow and not gpu"
fi
# The NIXL tests (and the prefill instance's, which serves a real NIXL side channel) run in their
# own process, apart from everything else's native libraries (grpc_tools' protoc extension loaded
# in-process once corrupted a later UCX agent's heap: test_grpc_proto.py runs protoc as a child now).
.venv/bin/python -m pytest -ra -m "$M" tests/kv_transfer tests/serving/test_prefill_instance.py "$@"
# The pool's tests start local Ray clusters (and fake GPUs): their own process too.
.venv/bin/python -m pytest -ra -m "$M" tests/cluster "$@"
exec .venv/bin/python -m pytest -ra -m "$M" --ignore=tests/kv_transfer --ignore=tests/cluster \
  --ignore=tests/serving/test_prefill_instance.py "$@"

#!/usr/bin/env bash
# The default test run: set-up (idempotent), then every test that needs no GPU, the end-to-end tests
# against a real vLLM decode included. Extra pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFILL_E2E_REQUIRED=${PREFILL_E2E_REQUIRED:-1}
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -ra "$@"

#!/usr/bin/env bash
# Set up everything the tests need (pinned .venv, the default model) and run the whole suite, whole modules on
# LORA_LLM_TEST_WORKERS (2) processes at once (pytest-xdist; 0 or 1: one process, in order).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` or `scripts/test.sh tests/kernels`.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
cd "$ROOT"
ensure_nginx
python scripts/prepare_model.py
workers="${LORA_LLM_TEST_WORKERS:-2}"
if [ "$workers" -gt 1 ]; then
  exec python -m pytest -n "$workers" --dist loadfile "$@"
fi
exec python -m pytest "$@"

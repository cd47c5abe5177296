#!/usr/bin/env bash
# Set up everything the tests need (pinned .venv, the default model) and run the whole suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` or `scripts/test.sh tests/kernels`.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
cd "$ROOT"
ensure_nginx
python scripts/prepare_model.py
exec python -m pytest "$@"

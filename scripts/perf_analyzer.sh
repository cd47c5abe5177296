#!/usr/bin/env bash
# perf_analyzer against a running server (scripts/serve.sh): streaming gRPC, generated input data.
#   scripts/perf_analyzer.sh [--concurrency 4] [--lora-task-id 1] [--lora-dir DIR --lora-task-id N] [-- PA_ARGS]
set -euo pipefail
source "$(dirname "$0")/setup.sh"
exec python "$ROOT/scripts/run_perf_analyzer.py" "$@"

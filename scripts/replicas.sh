#!/usr/bin/env bash
# Several replicas of the server (tritonserver + the OpenAI API each) behind nginx with adapter affinity.
#   scripts/replicas.sh [--replicas 3] [--port 9000] [--balance hash|round-robin] [--adapter-store DIR] ...
# Options as scripts/replicas.py takes them; Ctrl-C stops everything.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
cd "$ROOT"
ensure_nginx
python scripts/prepare_model.py
args=("$@")
if [[ " $* " != *" --adapter-store "* && " $* " != *" --model-dir "* ]]; then
  args+=(--adapter-store demo_adapters -- --lora-prefetch-dir demo_adapters)
fi
exec python scripts/replicas.py "${args[@]}"

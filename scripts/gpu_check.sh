#!/usr/bin/env bash
# The one check of the GPU path, for a machine with an NVIDIA GPU and no network where PyTorch, Triton,
# transformers, PEFT and pytest are already installed (it installs nothing; torch 2.11 / triton 3.6 / Python 3.12
# work as well as our pins). Builds its models in temporary dirs.
#   1. the environment (GPU, versions); 2. every kernel configuration compiled for sm_80/sm_90 by this Triton;
#   3. the tests marked `cuda` (kernels vs the torch references at real shapes, engine greedy == transformers/PEFT
#      in fp32, bf16 within tolerance, adapter churn, a step under torch.cuda.set_sync_debug_mode("error"));
#      with more than one GPU visible, tensor parallelism at TP=2 over NCCL against TP=1 (tests/backend/model/
#      test_tensor_parallel.py; it skips with "needs 2 CUDA devices" on one);
#   4. the real tritonserver with the engine on the GPU, at SmolLM2's and Llama-3.1-8B's shapes: bench/server_check.py
#      (gRPC streams with LoRA and DoRA adapters, a cancel, the ensemble's text and the OpenAI API, each against the
#      same request in process; at the first shape also a SIGKILL under the supervisor) and bench/server_bench.py
#      (W4 against W1 at concurrency 16 and 64, 128 streams at SmolLM2's shape). Where nvidia-pytriton or
#      tritonclient is not installed, from the bundle of scripts/pack_server.py (.bundle/server-py<python>.tar.xz,
#      or LORA_LLM_SERVER_BUNDLE_FILE), unpacked by scripts/unpack_server.sh. Without a GPU, the same at tiny-shape;
#   5. the GPU bench (scripts/gpu_bench.py: W1, W2, W3 on SmolLM2-135M and Llama-3.1-8B shapes vs HF + PEFT, the
#      LoRA kernels per projection and what of them stays on the critical path beside the GEMMs, the adapter-count
#      curve, time to ready), then the LoRA kernels of an 8B decode step under Nsight Compute (bench/ncu_lora.py).
# Also the start-up kernel self-check at SmolLM2's and Llama-3.1-8B's shapes. It ends with one verdict line per part
# and writes everything to $GPU_CHECK_REPORT (gpu_check_report.txt): the file to attach to a bug report.
#
#   scripts/gpu_check.sh [--tests-only | --server | --bench-only | --churn] [gpu_bench.py / gpu_churn.py arguments]
# --churn: W5's adapter churn alone (bench/gpu_churn.py: upload times, W5 through 8 and 32 slots against W1).
# With its defaults the bench fits a 10-minute call on one H100 or H200 (both shapes; the HF + PEFT baselines on 16
# requests each); the tests and the server check fit another.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

REPORT="${GPU_CHECK_REPORT:-gpu_check_report.txt}"      # everything below, for a bug report
OUT_DIR="${GPU_CHECK_OUT:-.}"                           # the server check's and W4's JSON
exec > >(tee "$REPORT") 2>&1
part=all
case "${1:-}" in
  --tests-only) part=tests; shift ;;
  --bench-only) part=bench; shift ;;
  --server) part=server; shift ;;
  --churn) part=churn; shift ;;
esac

verdicts=()
failed=()
step() {                                  # step LABEL TITLE COMMAND...: a failure is reported at the end, with
  local label=$1 title=$2 start=$SECONDS  # each step's seconds (what the next device call can budget by)
  shift 2
  echo "== $title"
  if "$@"; then
    verdicts+=("gpu_check verdict: $label: passed ($((SECONDS - start)) s)")
  else
    verdicts+=("gpu_check verdict: $label: FAILED ($((SECONDS - start)) s)")
    failed+=("$label")
  fi
}
compile_all() {                           # print the failures and the summary, not the "ok" lines
  "$PYTHON" scripts/compile_kernels.py --targets 80,90 --jobs "$(nproc)" | grep -v "^ok "
}
environment() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PYTHON" - <<'PY'
import sys
import peft, torch, transformers, triton
assert torch.cuda.is_available(), "gpu_check: torch sees no CUDA device"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}, {torch.cuda.get_device_name()}, "
      f"compute capability {torch.cuda.get_device_capability()}, {torch.cuda.device_count()} GPU(s)")
PY
}
self_check() {                            # the start-up self-check on this GPU at SmolLM2's and 8B's shapes, strict
                                          # (INT8, INT4 and FP8 weights and INT8 and FP8 KV caches checked too)
  "$PYTHON" - <<'PY'
import torch
from backend.device import resolve_dtype
from backend.model.checkpoint import ModelConfig
from backend.model.self_check import check_kernels, gemm_checks
from kernels.dispatch import load_ops
device = torch.device("cuda")
dtype = resolve_dtype("auto", device)
shapes = {"smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3),
          "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                               num_key_value_heads=8)}
failed = 0
for name, shape in shapes.items():
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "num_hidden_layers": 1,
                               "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, **shape})
    checks = check_kernels(load_ops("triton", device), cfg, dtype, dtype, device, 16, 64, weight_dtype="int8",
                           kv_cache_dtype="int8", lm_head_dtype="int8")   # the quantized paths too: INT8 GEMMs
                                                                          # (the LM head's too), INT8 KV,
    checks += [c for c in check_kernels(load_ops("triton", device), cfg, dtype, dtype, device, 16, 64,
                                        kv_cache_dtype="fp8") if "fp8 cache" in c.what]   # an FP8 KV cache
    with torch.inference_mode():                                  # and the INT4 and FP8 GEMMs
        checks += [c for fmt in ("int4", "fp8") for c in gemm_checks(load_ops("triton", device), cfg, dtype, device,
                                                                     fmt)]
    for check in checks:
        print(f"{'ok  ' if check.error is None else 'FAIL'} {name} {check.family}: {check.what}"
              + (f": {check.error}" if check.error else ""))
        failed += check.error is not None
raise SystemExit(1 if failed else 0)
PY
}
if [ "$part" != server ]; then
  step environment "environment" environment
elif "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  environment
else                                      # the server part also runs on CPU, at tiny-shape (the bundle's test)
  echo "gpu_check: no CUDA device: the server part runs on CPU"
fi
server() {                                # the server check and W4 per shape; from the bundle where needed
  echo "== the real tritonserver on this machine"
  if [ -n "${LORA_LLM_SERVER_BUNDLE_FILE:-}" ] || ! "$PYTHON" -c 'import importlib.util as u, sys
sys.exit(u.find_spec("pytriton") is None or u.find_spec("tritonclient") is None)'; then
    if ! source scripts/unpack_server.sh ${LORA_LLM_SERVER_BUNDLE_FILE:-}; then
      verdicts+=("gpu_check verdict: server: FAILED (the server bundle, above)"); failed+=(server)
      return
    fi
  fi
  local device shapes bench
  device="$("$PYTHON" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')"
  shapes=(smollm2-135m-shape llama-3.1-8b-shape)
  bench=()
  if [ "$device" = cpu ]; then                # the same code in seconds: a tiny model, a few requests
    shapes=(tiny-shape)
    bench=(--requests 8 --concurrency 4 --wide 0)
  fi
  local models crash=--crash
  models="$(mktemp -d)"
  for shape in "${shapes[@]}"; do
    step "server_$shape" "server check at $shape on $device" timeout "${SERVER_CHECK_TIMEOUT_S:-300}" \
      "$PYTHON" bench/server_check.py --shape "$shape" --device "$device" --models-dir "$models" $crash \
      --out "$OUT_DIR/server_check_$shape.json"
    crash=
    step "W4_$shape" "W4 against W1 at $shape on $device" timeout "${SERVER_BENCH_TIMEOUT_S:-420}" \
      "$PYTHON" bench/server_bench.py --models "$shape" --device "$device" --models-dir "$models" "${bench[@]}" \
      --out "$OUT_DIR/server_bench_$shape.json"
  done
  rm -rf "$models"
}
if [ "$part" = server ]; then
  server
fi
if [ "$part" = all ] || [ "$part" = tests ]; then
  step compile "kernels compiled for sm_80 and sm_90 by this Triton" compile_all
  step self_check "kernel self-check on this GPU (SmolLM2 and Llama-3.1-8B shapes)" self_check
  workers=()                              # pytest-xdist where installed: 288 CUDA tests in 55-69 s with 8 on an H100
  if "$PYTHON" -c 'import xdist' 2>/dev/null; then
    workers=(-n "$(( $(nproc) / 2 < 8 ? $(nproc) / 2 : 8 ))")
  fi
  step tests "tests on CUDA" "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda "${workers[@]}" tests/kernels tests/backend
  if [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -gt 1 ]; then
    step tensor_parallel "tensor parallel over NCCL (TP=2 == TP=1)" "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
      tests/backend/model/test_tensor_parallel.py -k cuda
  fi
fi
if [ "$part" = all ]; then
  server
fi
if [ "$part" = all ] || [ "$part" = bench ]; then
  step bench "GPU bench" "$PYTHON" scripts/gpu_bench.py "$@"
  step ncu "the LoRA kernels of an 8B decode step under Nsight Compute" \
    "$PYTHON" bench/ncu_lora.py --out "$OUT_DIR/ncu_lora.json"
fi
if [ "$part" = churn ]; then                # W5 at the 8B shape: a call of its own
  step churn "adapter churn (W5) at the Llama-3.1-8B shape" "$PYTHON" bench/gpu_churn.py \
    --out "$OUT_DIR/gpu_churn.json" "$@"
fi
printf '%s\n' "${verdicts[@]}"
echo "gpu_check: $SECONDS s in all; the whole output is in $REPORT (attach it to a bug report)"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu_check: passed"

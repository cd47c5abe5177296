"""python -m frontend --model-dir DIR [--grpc-url 127.0.0.1:8001] [--port 9000] [--adapter-store DIR] ...

The OpenAI-compatible API on tritonserver's core model. API keys come from the environment
(LORA_LLM_OPENAI_API_KEY for completions, chat and models; LORA_LLM_OPENAI_ADMIN_KEY for adapter loading) or from
--api-key-file (JSON: {"inference": "...", "admin": "..."}); they are never logged.
Loading adapters at run time is off unless --allow-runtime-lora-updating (or LORA_LLM_ALLOW_RUNTIME_LORA_UPDATING=true)
turns it on; then it needs an admin key distinct from the inference key (both keys off loopback), and loads only
from the adapter store and --lora-roots.
"""
import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWITCH_INTERVAL_S = 0.001     # the GIL's hand-over period (Python's default 5 ms): a thread building a large answer
                              # gives the event loop its turn within 1 ms, and /health takes a dozen such turns
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def api_keys(path: str | None) -> tuple[str | None, str | None]:
    inference = os.environ.get("LORA_LLM_OPENAI_API_KEY") or None
    admin = os.environ.get("LORA_LLM_OPENAI_ADMIN_KEY") or None
    if path:
        keys = json.loads(Path(path).read_text())
        inference, admin = keys.get("inference") or inference, keys.get("admin") or admin
    return inference, admin


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m frontend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "smollm2-135m-instruct"),
                        help="the base model's directory (config.json and tokenizer)")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    parser.add_argument("--core-model", default="lora_llm", help="the core model's name in tritonserver")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--served-model-name", help="the base model's name in `model` (default: the directory's)")
    parser.add_argument("--adapter-store", help="a directory of adapter folders, each served under its name")
    parser.add_argument("--lora-separator", default="_lora_", help="`model` may be <base><separator><adapter>")
    parser.add_argument("--api-key-file", help='JSON {"inference": KEY, "admin": KEY}')
    parser.add_argument("--core-metrics-url", help="tritonserver's metrics (e.g. http://127.0.0.1:8002/metrics), "
                                                   "served with the frontend's own at /metrics")
    parser.add_argument("--adapter-cache-bytes", type=int, default=1 << 30,
                        help="adapters held ready to send, read at start while they fit (fp16 TensorRT-LLM tensors)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        default=env_flag("LORA_LLM_ALLOW_RUNTIME_LORA_UPDATING"),
                        help="answer /v1/load_lora_adapter and /v1/unload_lora_adapter (needs an admin key)")
    parser.add_argument("--lora-roots", default="",
                        help="comma list of folders, besides the adapter store, that adapters may be loaded from")
    parser.add_argument("--max-lora-rank", type=int, default=int(os.environ.get("LORA_LLM_MAX_LORA_RANK", 64)),
                        help="the engine's max_lora_rank: loaded adapters are checked against it")
    parser.add_argument("--weight-dtype", default=os.environ.get("LORA_LLM_WEIGHT_DTYPE", "auto"),
                        help="the engine's weight_dtype: a PEFT DoRA adapter's magnitudes are normalized against the "
                             "weights it serves")
    args = parser.parse_args()

    import uvicorn

    from frontend.app import FrontendConfig, create_app
    inference_key, admin_key = api_keys(args.api_key_file)
    try:
        config = FrontendConfig(model_dir=args.model_dir, grpc_url=args.grpc_url, core_model=args.core_model,
                                served_model_name=args.served_model_name, adapter_store=args.adapter_store,
                                lora_separator=args.lora_separator, api_key=inference_key, admin_key=admin_key,
                                adapter_cache_bytes=args.adapter_cache_bytes, core_metrics_url=args.core_metrics_url,
                                allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                                lora_roots=tuple(r for r in args.lora_roots.split(",") if r),
                                max_lora_rank=args.max_lora_rank, weight_dtype=args.weight_dtype, host=args.host)
    except ValueError as err:
        sys.exit(f"[frontend] refusing to start: {err}")
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning", access_log=False)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


if __name__ == "__main__":
    main()

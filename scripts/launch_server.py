"""Start the tritonserver bundled in nvidia-pytriton on our model repository (see shared/RECIPES.md).

    python scripts/launch_server.py [--http-port 8000 --grpc-port 8001 --metrics-port 8002] [--model-dir DIR]
        [--lora-prefetch-dir DIR] [--model-repository DIR] [--models lora_llm,...] [--no-restart]
        [--decoupled_mode true|false] [--tensorrt_llm_model_name NAME] [--exit-timeout-s 30]
        [--openai-port 9000 | --no-openai] [--adapter-store DIR] [--lora-separator _lora_] [--api-key-file F]
        [--allow-runtime-lora-updating] [--lora-roots DIR,...]
Beside tritonserver runs the OpenAI-compatible API (python -m frontend) on its gRPC port. When either dies it is
logged (exit code or signal) and started again with backoff (scripts/supervisor.py). Ctrl-C or SIGTERM stops
them: in-flight requests get --exit-timeout-s to finish, then tritonserver is killed if it has not exited.
"""
import argparse
import os
import sys
from pathlib import Path

from render_repository import CORE, parse_bool, repository
from server_process import (EXIT_TIMEOUT_S, FRONTEND_NICE, KILL_AFTER_EXIT_TIMEOUT_S, ROOT, engine_alive, is_ready,
                            remove_dead_regions, start_frontend, start_server)
from supervisor import Service, supervise

from backend.serving.heartbeat import CORE_KEY_HEADER, CORE_KEY_VAR, SUPERVISED_VAR, end_engines  # noqa: E402

MIN_KEY_CHARS = 16


def frontend_args(args, adapter_store: Path | None) -> list[str]:
    out = ["--core-model", args.tensorrt_llm_model_name, "--lora-separator", args.lora_separator,
           "--core-metrics-url", f"http://127.0.0.1:{args.metrics_port}/metrics"]
    if adapter_store is not None:
        out += ["--adapter-store", str(adapter_store)]
    if args.served_model_name:
        out += ["--served-model-name", args.served_model_name]
    if args.api_key_file:
        out += ["--api-key-file", args.api_key_file]
    if args.allow_runtime_lora_updating:
        out += ["--allow-runtime-lora-updating"]
    if args.lora_roots:
        out += ["--lora-roots", args.lora_roots]
    return out


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def services(args, env: dict[str, str]) -> list[Service]:
    """tritonserver, and beside it the OpenAI-compatible API unless --no-openai (or the model has no tokenizer)."""
    core_host = args.host if args.expose_core else "127.0.0.1"
    triton = Service("tritonserver", lambda: start_server(
        args.http_port, args.grpc_port, args.metrics_port, args.model_repository, env,
        models=args.models and args.models.split(","), exit_timeout_s=args.exit_timeout_s, host=core_host,
        die_with_us=True),
        ready=lambda process: is_ready(args.http_port),
        on_ready=lambda restarts: print_ready(args) if restarts == 0 else
        print(f"[launch_server] ready again after restart {restarts}", flush=True),
        grace_s=args.exit_timeout_s + KILL_AFTER_EXIT_TIMEOUT_S, healthy=lambda: engine_alive(args.metrics_port))
    settings = os.environ | env                                    # the engine's: LORA_LLM_* from either
    model_dir = Path(settings.get("LORA_LLM_MODEL_DIR", ROOT / "models" / "smollm2-135m-instruct"))
    if not args.openai:
        return [triton]
    if not has_tokenizer(model_dir):
        print(f"[launch_server] {model_dir} has no tokenizer: no OpenAI-compatible API", flush=True)
        return [triton]
    store = args.adapter_store or settings.get("LORA_LLM_LORA_PREFETCH_DIR")
    frontend = Service("openai", lambda: start_frontend(model_dir, args.grpc_port, args.openai_port, *frontend_args(
                           args, Path(store).resolve() if store else None), nice=args.openai_nice, host=args.host,
                           die_with_us=True),
                       ready=lambda process: is_ready(args.openai_port, "/health"),
                       on_ready=lambda restarts: print(f"[launch_server] openai ready on http://127.0.0.1:"
                                                       f"{args.openai_port}/v1" + (f" again after restart {restarts}"
                                                                                  if restarts else ""), flush=True),
                       grace_s=10)
    return [triton, frontend]


def print_ready(args) -> None:
    print(f"\nready: gRPC 127.0.0.1:{args.grpc_port}, HTTP 127.0.0.1:{args.http_port}, "
          f"metrics http://127.0.0.1:{args.metrics_port}/metrics", flush=True)
    print("try:", flush=True)
    url = f"--url 127.0.0.1:{args.grpc_port}"
    print(f'  .venv/bin/python -m client {url} --stream --text "What is the capital of France?"')
    for task_id, name in ((1, "UPPER CASE"), (2, "sign-off line")):
        print(f'  .venv/bin/python -m client {url} --stream --lora-task-id {task_id} '
              f'--text "Tell me about the sea."      # demo adapter: {name}')
    if args.openai:
        print(f"  curl http://127.0.0.1:{args.openai_port}/v1/chat/completions -H 'Content-Type: application/json' "
              """-d '{"model": "uppercase", "messages": [{"role": "user", "content": "Tell me about the sea."}]}'""")
    print("Ctrl-C stops the server.", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address the OpenAI API listens on (0.0.0.0 in a pod); tritonserver's ports stay on "
                             "127.0.0.1 unless --expose-core")
    parser.add_argument("--expose-core", action="store_true",
                        help="tritonserver's gRPC, HTTP and metrics ports on --host too, for TensorRT-LLM clients "
                             "from other machines: every protocol but health and metadata then asks for the key of "
                             f"${CORE_KEY_VAR} (or --core-key-file) in the {CORE_KEY_HEADER!r} header")
    parser.add_argument("--core-key-file", help=f"a file holding the key of --expose-core (else ${CORE_KEY_VAR})")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--model-dir", help="any HF Llama-family directory with a tokenizer")
    parser.add_argument("--lora-prefetch-dir", help="<dir>/<task_id>/ adapters loaded at start")
    parser.add_argument("--models", help="load only these models of the repository (comma list)")
    parser.add_argument("--no-restart", dest="restart", action="store_false",
                        help="exit when tritonserver dies instead of starting it again")
    parser.add_argument("--decoupled_mode", type=parse_bool, default=True,
                        help="false: one response per request (unary ModelInfer, HTTP generate), no streaming")
    parser.add_argument("--exit-timeout-s", type=int, default=EXIT_TIMEOUT_S,
                        help="on Ctrl-C or SIGTERM, seconds in-flight requests get to finish (then it is killed)")
    parser.add_argument("--tensor_parallel_size", type=int,
                        help="ranks the model is split over (model parameter tensor_parallel_size; default 1)")
    parser.add_argument("--tensorrt_llm_model_name", default=CORE,
                        help="the core model's name (tensorrt_llm for clients that hard-code it)")
    parser.add_argument("--openai-port", type=int, default=9000, help="the OpenAI-compatible API's port")
    parser.add_argument("--no-openai", dest="openai", action="store_false", help="no OpenAI-compatible API")
    parser.add_argument("--adapter-store", help="adapters served by name on the OpenAI API (default: the prefetch dir)")
    parser.add_argument("--lora-separator", default="_lora_", help="OpenAI `model` may be <base><separator><adapter>")
    parser.add_argument("--served-model-name", help="the base model's name on the OpenAI API")
    parser.add_argument("--api-key-file", help='OpenAI API keys, JSON {"inference": KEY, "admin": KEY}')
    parser.add_argument("--openai-nice", type=int, default=FRONTEND_NICE,
                        help="the OpenAI API's niceness (below the engine's, where they share cores)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="the OpenAI API loads and unloads adapters at run time (also "
                             "LORA_LLM_ALLOW_RUNTIME_LORA_UPDATING=true); needs an admin key")
    parser.add_argument("--lora-roots", help="comma list of folders, besides the adapter store, that the OpenAI API "
                                             "may load adapters from")
    args = parser.parse_args()
    if args.core_key_file:
        os.environ[CORE_KEY_VAR] = Path(args.core_key_file).read_text().strip()    # for every child: the API too
    if args.expose_core and len(os.environ.get(CORE_KEY_VAR, "")) < MIN_KEY_CHARS:
        parser.error(f"--expose-core needs a key of at least {MIN_KEY_CHARS} characters in ${CORE_KEY_VAR} or "
                     "--core-key-file: tritonserver's ports would take anyone's requests and adapter uploads")
    if not args.expose_core:
        os.environ.pop(CORE_KEY_VAR, None)             # on loopback, as before: no key asked
    if args.model_repository == ROOT / "model_repository":
        args.model_repository = repository(ROOT / ".run" / "model_repository", args.decoupled_mode,
                                           args.tensorrt_llm_model_name)
    env = {}
    if args.model_dir:
        env["LORA_LLM_MODEL_DIR"] = str(Path(args.model_dir).resolve())
    if args.tensor_parallel_size:
        env["LORA_LLM_TENSOR_PARALLEL_SIZE"] = str(args.tensor_parallel_size)
    if args.lora_prefetch_dir:
        env["LORA_LLM_LORA_PREFETCH_DIR"] = str(Path(args.lora_prefetch_dir).resolve())
    if args.restart:
        env[SUPERVISED_VAR] = "1"                       # a stub dead with requests in flight: restart tritonserver
    code = supervise(services(args, env), restart=args.restart)
    remove_dead_regions(args.http_port)                # a stub killed on the way out leaves its regions,
    end_engines(args.http_port)                        # and its engines outlive it
    sys.exit(code)


if __name__ == "__main__":
    main()

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
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

from render_repository import CORE, parse_bool, repository
from supervisor import Service, supervise

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(ROOT))
from backend.heartbeat import die_with_parent, engine_health  # noqa: E402  (framework-free: imports nothing heavy)
EXIT_TIMEOUT_S = 30                    # tritonserver's own default for --exit-timeout-secs
QUICK_EXIT_TIMEOUT_S = 5               # a server stopped once its own streams have ended (benches, checks, tests)
KILL_AFTER_EXIT_TIMEOUT_S = 5          # past tritonserver's exit timeout, before SIGKILL (see stop_server)
# glibc raises its mmap threshold to the largest block freed so far, after which the multi-MB inputs of adapter
# uploads come from heap arenas that keep the memory once they are freed (tritonserver's RSS only grew under the
# soak, 2 GB after the load stopped); the threshold fixed at its initial 128 KiB maps each such block and returns it
# when freed. The engine's stub runs without it (its step tensors are reused from the heap).
MMAP_THRESHOLD_VAR, MMAP_THRESHOLD_BYTES = "MALLOC_MMAP_THRESHOLD_", 128 << 10
# Triton's gRPC frontend keeps request objects for reuse, and a reused protobuf keeps the capacity of the largest
# message it held: every request object in circulation ends up holding a multi-MB adapter upload (tritonserver grew
# ~40 MB/min under the soak with the mmap threshold fixed, and ~6 MB per request in flight). Without the pool its
# memory follows the requests in flight.
GRPC_REQUEST_POOL_SIZE = 0
FRONTEND_NICE = 10                     # the OpenAI frontend's niceness (see start_frontend)


def free_ports(n: int) -> list[int]:
    """n TCP ports free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def pytriton_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None:
        sys.exit("nvidia-pytriton is not installed (scripts/setup.sh installs it)")
    return Path(spec.submodule_search_locations[0])


def backend_dir() -> Path:
    """BE/python/ with the Python backend library, its utils and the 3.11 stub side by side; the stub through a
    wrapper that runs it without tritonserver's malloc setting. Each is renamed into place, so that servers starting
    at once never find one missing."""
    tritonserver = pytriton_dir() / "tritonserver"
    be = Path(sys.prefix) / "triton_backends"
    (be / "python").mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    links = {"libtriton_python.so": tritonserver / "backends/python/libtriton_python.so",
             "triton_python_backend_utils.py": tritonserver / "backends/python/triton_python_backend_utils.py",
             "triton_python_backend_stub": tritonserver / f"python_backend_stubs/{version}/triton_python_backend_stub"}
    for name, target in links.items():
        link = be / "python" / name
        staged = link.with_name(f".{name}.{os.getpid()}")
        staged.unlink(missing_ok=True)
        if name == "triton_python_backend_stub":
            staged.write_text(f"#!/bin/sh\nunset {MMAP_THRESHOLD_VAR}\nexec '{target}' \"$@\"\n")
            staged.chmod(0o755)
        else:
            staged.symlink_to(target)
        os.replace(staged, link)
    return be


def server_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    stub_bin = Path(os.environ["LORA_LLM_STUB_VENV"]) / "bin" if os.environ.get("LORA_LLM_STUB_VENV") else \
        Path(sys.executable).parent
    env["PATH"] = f"{stub_bin}:{env.get('PATH', '')}"          # the stub finds its venv here (scripts/unpack_server.sh)
    libs = [sysconfig.get_config_var("LIBDIR")]
    if not os.environ.get("LORA_LLM_TRITONSERVER"):
        libs.append(str(pytriton_dir().parent / "nvidia_pytriton.libs"))
    env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault(MMAP_THRESHOLD_VAR, str(MMAP_THRESHOLD_BYTES))
    env.update(overrides or {})
    return env


def start_server(http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 model_repository: Path = ROOT / "model_repository", env: dict[str, str] | None = None,
                 log_file=None, models: list[str] | None = None, exit_timeout_s: int = EXIT_TIMEOUT_S,
                 host: str = "127.0.0.1", die_with_us: bool = False) -> subprocess.Popen:
    """Start tritonserver in the background; `models` loads only those (all of the repository by default);
    die_with_us: killed when this process dies (a supervisor's children).
    exit_timeout_s: how long a SIGTERM waits for in-flight requests (tritonserver's --exit-timeout-secs).
    The server is the one nvidia-pytriton bundles, or an installed one (an NGC tritonserver image's):
    LORA_LLM_TRITONSERVER names its binary and LORA_LLM_BACKEND_DIRECTORY its backends."""
    binary = os.environ.get("LORA_LLM_TRITONSERVER") or pytriton_dir() / "tritonserver" / "bin" / "tritonserver"
    backends = os.environ.get("LORA_LLM_BACKEND_DIRECTORY") or backend_dir()
    gpu_metrics = str(bool(os.environ.get("LORA_LLM_TRITONSERVER"))).lower()
    cmd = [str(binary), "--model-repository", str(model_repository), "--backend-directory", str(backends),
           "--disable-auto-complete-config", "--allow-gpu-metrics", gpu_metrics, "--pinned-memory-pool-byte-size", "0",
           "--http-address", host, "--grpc-address", host, "--metrics-address", host,
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
           "--exit-timeout-secs", str(exit_timeout_s),
           "--grpc-infer-allocation-pool-size", str(GRPC_REQUEST_POOL_SIZE)]
    if models:
        cmd += ["--model-control-mode", "explicit"] + [f"--load-model={name}" for name in models]
    # a process group of its own: when it dies, its stubs (and their workers) are ended with it (supervisor.py)
    return subprocess.Popen(cmd, env=server_env(env), stdout=log_file, stderr=subprocess.STDOUT if log_file else None,
                            start_new_session=True, preexec_fn=die_with_parent if die_with_us else None)


def stop_server(process: subprocess.Popen, exit_timeout_s: int = EXIT_TIMEOUT_S) -> None:
    """SIGTERM to tritonserver; SIGKILL to its process group (its stubs with it) if it is still there
    KILL_AFTER_EXIT_TIMEOUT_S after its exit timeout. tritonserver 2.51 never unloads a model while its gRPC frontend
    holds a request of a stream the client cancelled after the final response (before the call's status came), and
    its exit past the timeout with the model still loaded can corrupt its heap and hang in its own abort handler."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=exit_timeout_s + KILL_AFTER_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def wait_ready(process: subprocess.Popen, http_port: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {process.returncode} before it was ready")
        if is_ready(http_port):
            return
        time.sleep(0.5)
    raise TimeoutError(f"tritonserver not ready after {timeout_s} s")


def is_ready(http_port: int, path: str = "/v2/health/ready") -> bool:
    """Whether the endpoint answers 200; any failure to get that answer (refused, reset, a malformed status line
    from a server still starting, a timeout) is a no."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def engine_alive(metrics_port: int) -> bool:
    """False once a model's engine cannot serve: it says so (lora_llm_engine_alive 0: a tensor-parallel worker lost,
    steps failing in a row), or its heartbeat went stale (its stub process died, its loop is stuck; see
    backend/heartbeat.py). True while it serves, and when the metrics cannot be read (readiness covers that)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except Exception:
        return True
    return engine_health(text) is None


def start_frontend(model_dir: Path, grpc_port: int, port: int, *args: str, nice: int = FRONTEND_NICE,
                   log_file=None, host: str = "127.0.0.1", die_with_us: bool = False) -> subprocess.Popen:
    """The OpenAI-compatible API (python -m frontend) on a core model's gRPC port, `nice` below the engine: where
    they share cores, a step waits for every thread of its team, and a frontend that preempts one delays them all
    (W10 at 32 requests, this 2-core machine: decode steps 51.8-53.1 ms at nice 0, 48.1-51.8 at 10, against
    44.2-47.8 ms through gRPC alone)."""
    cmd = ["nice", "-n", str(nice), sys.executable, "-m", "frontend", "--model-dir", str(model_dir), "--grpc-url",
           f"127.0.0.1:{grpc_port}", "--host", host, "--port", str(port), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=server_env(), stdout=log_file,
                            stderr=subprocess.STDOUT if log_file else None, start_new_session=True,
                            preexec_fn=die_with_parent if die_with_us else None)


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
                        help="tritonserver's gRPC, HTTP and metrics ports on --host too: TensorRT-LLM clients and "
                             "perf_analyzer from other machines (those ports have no keys)")
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
    if args.expose_core and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"[launch_server] WARNING: --expose-core: tritonserver's ports listen on {args.host} with no keys: "
              "anyone who reaches them can run and upload adapters to the core model", flush=True)
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
    sys.exit(supervise(services(args, env), restart=args.restart))


if __name__ == "__main__":
    main()

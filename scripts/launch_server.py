"""Start the tritonserver bundled in nvidia-pytriton on our model repository (see shared/RECIPES.md).

    python scripts/launch_server.py [--http-port 8000 --grpc-port 8001 --metrics-port 8002] [--model-dir DIR]
        [--lora-prefetch-dir DIR] [--model-repository DIR] [--models lora_llm,...] [--no-restart]
        [--decoupled_mode true|false] [--tensorrt_llm_model_name NAME] [--exit-timeout-s 30]
When tritonserver dies it is logged (exit code or signal) and started again with backoff. Ctrl-C or SIGTERM
stops it: in-flight requests get --exit-timeout-s to finish, then tritonserver is killed if it has not exited.
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

ROOT = Path(__file__).resolve().parent.parent
EXIT_TIMEOUT_S = 30                    # tritonserver's own default for --exit-timeout-secs
KILL_AFTER_EXIT_TIMEOUT_S = 5          # past tritonserver's exit timeout, before SIGKILL


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
    """BE/python/ with the Python backend library, its utils and the 3.11 stub side by side."""
    tritonserver = pytriton_dir() / "tritonserver"
    be = Path(sys.prefix) / "triton_backends"
    (be / "python").mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    links = {"libtriton_python.so": tritonserver / "backends/python/libtriton_python.so",
             "triton_python_backend_utils.py": tritonserver / "backends/python/triton_python_backend_utils.py",
             "triton_python_backend_stub": tritonserver / f"python_backend_stubs/{version}/triton_python_backend_stub"}
    for name, target in links.items():
        link = be / "python" / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return be


def server_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"          # the stub finds the venv here
    libs = [sysconfig.get_config_var("LIBDIR"), str(pytriton_dir().parent / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    env.update(overrides or {})
    return env


def start_server(http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 model_repository: Path = ROOT / "model_repository", env: dict[str, str] | None = None,
                 log_file=None, models: list[str] | None = None,
                 exit_timeout_s: int = EXIT_TIMEOUT_S) -> subprocess.Popen:
    """Start tritonserver in the background; `models` loads only those (all of the repository by default).
    exit_timeout_s: how long a SIGTERM waits for in-flight requests (tritonserver's --exit-timeout-secs)."""
    binary = pytriton_dir() / "tritonserver" / "bin" / "tritonserver"
    cmd = [str(binary), "--model-repository", str(model_repository), "--backend-directory", str(backend_dir()),
           "--disable-auto-complete-config", "--allow-gpu-metrics", "false", "--pinned-memory-pool-byte-size", "0",
           "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1",
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
           "--exit-timeout-secs", str(exit_timeout_s)]
    if models:
        cmd += ["--model-control-mode", "explicit"] + [f"--load-model={name}" for name in models]
    return subprocess.Popen(cmd, env=server_env(env), stdout=log_file, stderr=subprocess.STDOUT if log_file else None)


def wait_ready(process: subprocess.Popen, http_port: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"tritonserver not ready after {timeout_s} s")


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def supervise(args, env: dict[str, str]) -> int:
    """Run tritonserver and start it again whenever it dies (backoff 1, 2, 4 ... 30 s; back to 1 s after a
    minute up). Adapters in the prefetch dir come back with it; clients retry what was in flight."""
    stopping_since: float | None = None
    process: subprocess.Popen | None = None

    def stop(*_):
        nonlocal stopping_since
        stopping_since = stopping_since or time.monotonic()
        if process is not None:
            process.terminate()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    restarts, delay = 0, 1.0
    while stopping_since is None:                     # a stop during a restart's backoff starts nothing
        process = start_server(args.http_port, args.grpc_port, args.metrics_port, args.model_repository, env,
                               models=args.models and args.models.split(","), exit_timeout_s=args.exit_timeout_s)
        started = time.monotonic()
        print(f"[launch_server] tritonserver pid {process.pid} (restarts so far: {restarts})", flush=True)
        try:
            wait_ready(process, args.http_port)
            if restarts == 0:
                print_ready(args.grpc_port, args.http_port, args.metrics_port)
            else:
                print(f"[launch_server] ready again after restart {restarts}", flush=True)
        except (RuntimeError, TimeoutError) as err:
            if stopping_since is not None:
                return 0
            process.terminate()
            if restarts == 0:                         # a server that never came up is a setup error, not a crash
                sys.exit(str(err))
        code = wait_exit(process, lambda: stopping_since, args.exit_timeout_s + KILL_AFTER_EXIT_TIMEOUT_S)
        if stopping_since is not None or not args.restart:
            return code
        delay = 1.0 if time.monotonic() - started > 60 else min(30.0, delay * 2 if restarts else delay)
        restarts += 1
        print(f"[launch_server] tritonserver died ({describe_exit(code)}); restart {restarts} in {delay:.0f} s",
              flush=True)
        time.sleep(delay)
    return 0


def wait_exit(process: subprocess.Popen, stopping_since, grace_s: float) -> int:
    """process's exit code; killed once grace_s have passed since stopping_since() (None while not stopping).
    tritonserver does not exit on SIGTERM while a client keeps a gRPC stream open, even with nothing in flight on
    it ("Exiting immediately" after its exit timeout, and it runs on)."""
    while True:
        try:
            return process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            since = stopping_since()
            if since is not None and time.monotonic() - since > grace_s:
                print(f"[launch_server] tritonserver still running {grace_s:.0f} s after SIGTERM (a client holds a "
                      "gRPC stream open?); killing it", flush=True)
                process.kill()
                return process.wait()


def print_ready(grpc_port: int, http_port: int, metrics_port: int) -> None:
    print(f"\nready: gRPC 127.0.0.1:{grpc_port}, HTTP 127.0.0.1:{http_port}, "
          f"metrics http://127.0.0.1:{metrics_port}/metrics", flush=True)
    print("try:", flush=True)
    print(f'  .venv/bin/python -m client --url 127.0.0.1:{grpc_port} --stream --text "What is the capital of France?"')
    for task_id, name in ((1, "UPPER CASE"), (2, "sign-off line")):
        print(f'  .venv/bin/python -m client --url 127.0.0.1:{grpc_port} --stream --lora-task-id {task_id} '
              f'--text "Tell me about the sea."      # demo adapter: {name}')
    print("Ctrl-C stops the server.", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--tensorrt_llm_model_name", default=CORE,
                        help="the core model's name (tensorrt_llm for clients that hard-code it)")
    args = parser.parse_args()
    if args.model_repository == ROOT / "model_repository":
        args.model_repository = repository(ROOT / ".run" / "model_repository", args.decoupled_mode,
                                           args.tensorrt_llm_model_name)
    env = {}
    if args.model_dir:
        env["LORA_LLM_MODEL_DIR"] = str(Path(args.model_dir).resolve())
    if args.lora_prefetch_dir:
        env["LORA_LLM_LORA_PREFETCH_DIR"] = str(Path(args.lora_prefetch_dir).resolve())
    sys.exit(supervise(args, env))


if __name__ == "__main__":
    main()

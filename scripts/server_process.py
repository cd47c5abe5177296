"""tritonserver (the one nvidia-pytriton bundles, or an installed one) and the OpenAI API as child processes: where
the server's binary and backends are, its environment, start, readiness, health and a bounded stop. What the
launcher (scripts/launch_server.py), the benches, the checks and the tests start their servers with."""
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(ROOT))
from backend.processes import die_with_parent  # noqa: E402 (imports nothing heavy)
from backend.serving.heartbeat import (CORE_KEY_HEADER, CORE_KEY_VAR, RESTART_STALE_S, RESTRICTED,  # noqa: E402
                                       end_engines, engine_health)

SHM_DIR = Path("/dev/shm")
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
# tritonserver refreshes its CPU and GPU metrics on a thread that its exit waits for through one whole interval (2 s by
# default): an idle server's stop took 2.8-2.9 s, 2.0-2.1 s with 100 ms.
METRICS_INTERVAL_MS = 250
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
    die_with_us: killed when this process dies (a supervisor's children). With LORA_LLM_CORE_KEY in `env` (or this
    environment), every protocol but health and metadata asks for it in the `lora-llm-key` header, on gRPC and HTTP.
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
           "--exit-timeout-secs", str(exit_timeout_s), "--metrics-interval-ms", str(METRICS_INTERVAL_MS),
           "--grpc-infer-allocation-pool-size", str(GRPC_REQUEST_POOL_SIZE),
           f"--backend-config=python,shm-region-prefix-name={shm_prefix(http_port)}"]
    environment = server_env(env)
    if key := environment.get(CORE_KEY_VAR):
        cmd += [f"--grpc-restricted-protocol={RESTRICTED}:{CORE_KEY_HEADER}={key}",
                f"--http-restricted-api={RESTRICTED}:{CORE_KEY_HEADER}={key}"]
    # explicit control: the engine's process reloads the core model when a stub dies (backend/serving/engine_process.py)
    cmd += ["--model-control-mode", "explicit"] + [f"--load-model={name}" for name in models or ["*"]]
    remove_dead_regions(http_port)
    # a process group of its own: when it dies, its stubs (and their workers) are ended with it (supervisor.py)
    process = subprocess.Popen(cmd, env=environment, stdout=log_file,
                               stderr=subprocess.STDOUT if log_file else None, start_new_session=True,
                               preexec_fn=die_with_parent if die_with_us else None)
    process.http_port = http_port                  # (stop_server removes what its stubs leave)
    return process


def shm_prefix(http_port: int) -> str:
    """The prefix of the shared memory regions of the Python backend's stubs of the server on this port: one server
    owns it while it holds the port, so that what a dead instance left can be removed (remove_dead_regions)."""
    return f"lora_llm_{http_port}_"


def shm_regions(http_port: int) -> list[Path]:
    return sorted(SHM_DIR.glob(shm_prefix(http_port) + "*"))


def remove_dead_regions(http_port: int) -> int:
    """Remove the shared memory regions a server on this port left when its stubs or it died (a stub killed leaves
    its regions: 64 MB and more each); none while the port is held (a server lives there). Returns how many."""
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # (a dead server's connections in TIME_WAIT
            s.bind(("127.0.0.1", http_port))                           # do not hold the port; a listener does)
    except OSError:
        return 0
    regions = shm_regions(http_port)
    for path in regions:
        path.unlink(missing_ok=True)
    return len(regions)


def stop_server(process: subprocess.Popen, exit_timeout_s: int = EXIT_TIMEOUT_S) -> None:
    """SIGTERM to tritonserver; SIGKILL to its process group (its stubs with it) if it is still there
    KILL_AFTER_EXIT_TIMEOUT_S after its exit timeout; then its engine processes end (backend/heartbeat.end_engines).
    tritonserver 2.51 never unloads a model while its gRPC frontend holds a request of a stream the client cancelled
    after the final response (before the call's status came), and its exit past the timeout with the model still
    loaded can corrupt its heap and hang in its own abort handler."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=exit_timeout_s + KILL_AFTER_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    if hasattr(process, "http_port"):                 # (one start_server made): a stub killed leaves its regions,
        remove_dead_regions(process.http_port)        # and its engines outlive it
        end_engines(process.http_port)


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


def engine_alive(metrics_port: int, timeout_s: float = 5.0) -> bool:
    """False once a model's engine cannot serve: it says so (lora_llm_engine_alive 0: its process gone, a
    tensor-parallel worker lost, steps failing in a row), or its heartbeat has been stale for RESTART_STALE_S (its stub
    died and no new one came, its loop is stuck; see backend/serving/heartbeat.py), or tritonserver's metrics page
    does not answer within timeout_s (tritonserver hung: 2.51's handler of a fatal signal can deadlock in malloc,
    leaving a process that neither dies nor serves, docs/reliability.md). True while it serves."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except Exception as err:
        print(f"[launch_server] health check: tritonserver's metrics page did not answer ({err})", flush=True)
        return False
    why = engine_health(text, stale_s=RESTART_STALE_S)
    if why is not None:
        print(f"[launch_server] health check: {why}", flush=True)
    return why is None


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

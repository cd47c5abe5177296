"""tritonserver under the supervisor (scripts/launch_server.py) killed with SIGKILL mid-stream, for
bench/server_check.py --crash: the client gets an error within its timeout, no stub of the old server lives on,
the engine's process (backend/serving/engine_process.py) serves the restarted server (no second model load: the device
memory free while the first served is free after the restart), and the restarted server answers as the first did."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from server_probe import MAX_TOKENS, free_device_bytes, metric, processes, stream

ROOT = Path(__file__).resolve().parent.parent


def crash_check(settings: dict, args, base: tuple[list[int], list[int]], report: dict) -> list[str]:
    """SIGKILL tritonserver (its engine set up by `settings`) mid-stream under the supervisor; base: a prompt and
    the tokens the first server gave it. The failures found (none: passed)."""
    from client.grpc_client import input_arrays
    from server_process import QUICK_EXIT_TIMEOUT_S, free_ports, is_ready
    http, grpc, metrics = free_ports(3)
    free0 = free_device_bytes(args.device)
    launcher = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "launch_server.py"), "--http-port", str(http), "--grpc-port",
         str(grpc), "--metrics-port", str(metrics), "--no-openai", "--models", "lora_llm", "--exit-timeout-s", str(QUICK_EXIT_TIMEOUT_S)],
        env=os.environ | settings, start_new_session=True,
        stdout=open(args.work / "launcher.log", "w"), stderr=subprocess.STDOUT)
    failures, servers = [], set()
    try:
        deadline = time.monotonic() + args.timeout_s
        while not is_ready(http) and time.monotonic() < deadline:
            time.sleep(0.2)
        [server] = [pid for pid, (parent, cmd) in processes().items() if parent == launcher.pid and
                    "tritonserver" in cmd and f"--http-port {http} " in cmd]
        servers.add(server)
        engine, free_serving = engine_of(http), free_device_bytes(args.device)
        stubs = {pid for pid, (parent, cmd) in processes().items() if parent == server}
        prompt, want = base
        result = {}
        client = threading.Thread(target=lambda: result.update(zip(("chunks", "error"), stream(
            f"127.0.0.1:{grpc}", input_arrays(prompt, 512, True, end_id=-1), timeout_s=30))))
        client.start()
        while not metric(metrics, "lora_llm_kv_blocks", 'state="used"') and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)                                         # tokens on their way
        os.kill(server, signal.SIGKILL)
        killed = time.monotonic()
        client.join(timeout=60)
        report["client_error_after_s"] = time.monotonic() - killed
        if client.is_alive() or not result.get("error"):
            failures.append(f"the client got no error after the kill ({result})")
        gone_at = None
        while time.monotonic() < deadline and not is_ready(http):
            if gone_at is None and not stubs & processes().keys():
                gone_at = time.monotonic() - killed
            time.sleep(0.05)
        free_after = free_device_bytes(args.device)
        report.update(old_stubs_gone_after_s=gone_at, free_before_s=free0, free_serving=free_serving,
                      free_after_restart=free_after, engine_kept=engine_of(http) == engine)
        if gone_at is None:
            failures.append(f"old stubs {sorted(stubs & processes().keys())} alive after the restart")
        if engine_of(http) != engine:
            failures.append(f"the engine process {engine} did not serve the restarted server ({engine_of(http)})")
        if free_serving is not None and free_after < free_serving - (1 << 30):
            failures.append(f"a second model load: {free_serving / 2**30:.2f} GiB free while the first server "
                            f"served, {free_after / 2**30:.2f} GiB after the restart")
        servers |= {pid for pid, (parent, cmd) in processes().items() if parent == launcher.pid and
                    "tritonserver" in cmd and f"--http-port {http} " in cmd}              # the restarted one
        chunks, error = stream(f"127.0.0.1:{grpc}", input_arrays(prompt, MAX_TOKENS, True, end_id=-1))
        got = [int(t) for c in chunks for t in c.reshape(-1)]
        if error or got != want:
            failures.append(f"the restarted server answered {got} ({error}), want {want}")
        print(f"server_check: SIGKILL mid-stream: client error after {report['client_error_after_s']:.2f} s; old "
              f"stubs gone after {gone_at} s; the engine process kept: {report['engine_kept']}; free device memory "
              f"{free_serving} serving, {free_after} after the restart; restarted server "
              f"{'serves' if got == want else 'FAILED'}", flush=True)
    except Exception as err:
        failures.append(f"{type(err).__name__}: {err}")
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=60)
    left = stubs_of(servers)
    if left:
        failures.append(f"stubs {left} of tritonserver {sorted(servers)} alive 10 s after the launcher stopped")
    if failures:
        print(f"--- launcher log:\n{(args.work / 'launcher.log').read_text()[-3000:]}")
    return failures


def engine_of(http_port: int) -> int | None:
    """The pid of the engine process of the server on this port."""
    from backend.serving.heartbeat import engine_pids
    return min(engine_pids(http_port), default=None)


def stubs_of(servers: set[int], wait_s: float = 10.0) -> list[int]:
    """The Python backend stubs of those tritonservers (each stub's arguments name its server's pid) still alive
    after wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        left = sorted(pid for pid, (_, cmd) in processes().items() if "triton_python_backend_stub" in cmd
                      and any(f" {server} " in cmd for server in servers))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)

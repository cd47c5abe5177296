"""A sign of life from the engine that stops when the engine can no longer serve, for whoever watches it from outside;
where engine processes listen; the key tritonserver's exposed ports ask for.

Tritonserver keeps a Python model ready, and keeps serving its last metric values, after the model's stub process
has died (an input whose declared shape overflows kills the stub inside tritonserver 2.51's own code, before the
model sees the request): only a value that must keep changing tells the truth. `Heartbeat` publishes the time every
`period_s` while the engine loop is alive and no step has run past `max_step_s`; `engine_health` reads it back from
a metrics page (the supervisor's health check, the OpenAI API's /health). A stub's heartbeat watches its calls into
tritonserver the same way (`InFlight`, SERVER_CALL_S): tritonserver 2.51's gRPC frontend can deadlock between a
stream's cancellation check and its response (docs/reliability.md), after which no stream gets an answer while
health and metrics stay fine; a response it has not taken for that long is that, and the heartbeat stops."""
import os
import re
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from backend.processes import running

PERIOD_S = 0.25                               # how often a live engine says so
STALE_S = 1.0                                 # a heartbeat older than this: the engine or its stub is gone or stuck
RESTART_STALE_S = 20.0                        # stale this long, tritonserver is restarted (the engine's process asks
                                              # for a new stub at once when one dies; that takes seconds)
MAX_STEP_S = 120.0                            # a step running longer than this is stuck (no heartbeat while it runs)
SERVER_CALL_S = 10.0                          # a stub's call into tritonserver (a response, a cancellation check)
                                              # running longer: tritonserver is stuck (they take microseconds)
HEARTBEAT = "lora_llm_engine_heartbeat_seconds"
SUPERVISED_VAR = "LORA_LLM_SUPERVISED"        # set where a supervisor restarts tritonserver (scripts/launch_server.py)
CORE_KEY_VAR = "LORA_LLM_CORE_KEY"            # the key tritonserver's exposed ports ask for (launch_server --expose-core)
CORE_KEY_HEADER = "lora-llm-key"              # the HTTP header that carries it (gRPC: GRPC_KEY_PREFIX + it)
GRPC_KEY_PREFIX = "triton-grpc-protocol-"     # tritonserver's prefix to a restricted protocol's gRPC metadata key
RESTRICTED = "inference,model-repository,model-config,shared-memory,statistics,trace,logging"   # health, metadata: open
ALIVE = "lora_llm_engine_alive"


class InFlight:
    """The calls running now, by thread (a stub's calls into tritonserver): `oldest()` is the monotonic start of the
    longest-running one, or None, as Heartbeat's step_started. stuck_file (a test hook, the model's
    inject_stuck_call_file): once it exists, the next call removes it and never returns, as a call into a deadlocked
    tritonserver does."""

    def __init__(self, stuck_file: str | None = None):
        self.starts: dict[int, float] = {}
        self.stuck_file = stuck_file

    @contextmanager
    def call(self):
        ident = threading.get_ident()
        self.starts[ident] = time.monotonic()
        try:
            if self.stuck_file is not None:
                self._stick()
            yield
        finally:
            self.starts.pop(ident, None)

    def _stick(self) -> None:
        try:
            os.remove(self.stuck_file)
        except FileNotFoundError:
            return
        threading.Event().wait()

    def oldest(self) -> float | None:
        return min(self.starts.values(), default=None)


class Heartbeat:
    """Calls `beat(unix_time)` every period_s on a thread of its own while `alive()`, and `step_started()` (the
    monotonic start of the step running now, or None) is not older than max_step_s; says once on stderr when one
    is, naming it (`what`)."""

    def __init__(self, beat: Callable[[float], None], alive: Callable[[], bool],
                 step_started: Callable[[], float | None], period_s: float = PERIOD_S, max_step_s: float = MAX_STEP_S,
                 what: str = "a step"):
        self.beat, self.alive, self.step_started = beat, alive, step_started
        self.period_s, self.max_step_s, self.what = period_s, max_step_s, what
        self.num_errors = 0
        self.said: float | None = None        # the start of the overlong one said so
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self.thread.join(timeout=5)

    def healthy(self) -> bool:
        started = self.step_started()
        if started is not None and time.monotonic() - started > self.max_step_s:
            if self.said != started:
                self.said = started
                print(f"[heartbeat] {self.what} has run {time.monotonic() - started:.0f} s (over {self.max_step_s:g}):"
                      " stuck; no heartbeat until it ends", file=sys.stderr, flush=True)
            return False
        return self.alive()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if self.healthy():
                try:
                    self.beat(time.time())
                except Exception:                    # a metrics error is no reason to stop beating
                    self.num_errors += 1
            self._stopped.wait(self.period_s)


def engine_health(metrics_text: str, now: float | None = None, stale_s: float = STALE_S) -> str | None:
    """Why the engine behind this metrics page cannot serve, or None while it can (or the page has no engine)."""
    if re.search(rf"^{ALIVE}\{{[^}}]*\}} 0(\.0)?$", metrics_text, re.MULTILINE):
        return "the engine reports it cannot serve (lora_llm_engine_alive 0)"
    beats = [float(v) for v in re.findall(rf"^{HEARTBEAT}\{{[^}}]*\}} (\S+)$", metrics_text, re.MULTILINE)]
    if beats:
        age = (time.time() if now is None else now) - min(beats)
        if age > stale_s:
            return f"the engine's last heartbeat is {age:.1f} s old (its stub process died or its loop is stuck)"
    return None


def engines_dir() -> Path:
    """Where engine processes (backend/serving/engine_process.py) listen and leave their pids: a directory only this
    user can enter, since what connects there is trusted; under /tmp where $TMPDIR is long (a Unix socket's path holds
    at most 107 bytes)."""
    base = tempfile.gettempdir()
    folder = Path(base if len(base) <= 40 else "/tmp") / f"lora-llm-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} must belong to this user alone (mode 700)")
    return folder


def engine_pids(http_port: int) -> dict[int, Path]:
    """The engine processes of the tritonserver on this port, by their pid files (pid -> file)."""
    pids = {}
    for pid_file in engines_dir().glob(f"engine-port{http_port}-*.pid"):
        try:
            pids[int(pid_file.read_text())] = pid_file
        except (OSError, ValueError):
            continue
    return pids


def end_engines(http_port: int, timeout_s: float = 10.0) -> list[int]:
    """End the engine processes of the tritonserver on this port once it is stopped (an engine outlives its
    tritonserver, for a successor to find): SIGTERM, then SIGKILL to those still there after `timeout_s`. Their
    pids."""
    pids = engine_pids(http_port)
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(running(pid) for pid in pids):
        time.sleep(0.05)
    for pid, pid_file in pids.items():
        if running(pid):
            os.kill(pid, signal.SIGKILL)
        pid_file.unlink(missing_ok=True)
        pid_file.with_suffix(".sock").unlink(missing_ok=True)
    return sorted(pids)


def core_key_headers(protocol: str = "http") -> dict[str, str]:
    """The header (HTTP) or metadata (gRPC) our own clients of tritonserver send where its ports ask for a key
    ($LORA_LLM_CORE_KEY)."""
    key = os.environ.get(CORE_KEY_VAR, "")
    return {(GRPC_KEY_PREFIX if protocol == "grpc" else "") + CORE_KEY_HEADER: key} if key else {}

"""Keeps a deployment's processes running: each one that dies is logged (exit code or signal) and started again on its
own, while the others serve on: at once after a minute ready, else with backoff (1, 2, 4 ... 30 s; a minute ready
starts it over). One that runs but
says it cannot serve (its `healthy` check fails twice in a row) is killed and started again the same way. A stop
(SIGINT, SIGTERM) ends them all: each gets its grace period, then SIGKILL.

A service started in a process group of its own (start_new_session) is ended as a group: when it dies, whatever it
started (tritonserver's Python backend stubs, their tensor-parallel workers) is killed and waited for before it
starts again, and on a GPU until the device no longer lists them, so that an orphaned engine never holds the memory
its successor needs."""
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_BACKOFF_S = 30.0
STABLE_S = 60.0                               # ready this long, a death restarts at once (the back-off starts over)
GROUP_END_TIMEOUT_S = 30.0                    # a group's processes gone, and their device memory released


@dataclass
class Service:
    name: str
    start: Callable[[], subprocess.Popen]
    ready: Callable[[subprocess.Popen], bool]          # polled after a start until True
    on_ready: Callable[[int], None]                    # restart count (0: the first start)
    grace_s: float = 35.0                              # after SIGTERM, before SIGKILL
    process: subprocess.Popen | None = None
    restarts: int = 0
    delay_s: float = 0.0
    died_at: float | None = None                       # monotonic time of its last death, until it is ready again
    ready_at: float | None = None                      # when the running instance became ready
    restart_at: float | None = None                    # monotonic time of the next start, while down
    is_ready: bool = False
    must_start: bool = True                            # False: a failure before the first ready ends it all
    healthy: Callable[[], bool] | None = None          # polled every health_period_s once ready
    health_period_s: float = 1.0
    next_health_check: float = 0.0
    num_unhealthy: int = 0                             # failed health checks in a row
    log: Callable[[str], None] = field(default=lambda line: print(f"[launch_server] {line}", flush=True))

    group: int | None = None                           # the process group of the last start, when its own

    def launch(self) -> None:
        if self.group is not None:                     # nothing of the previous instance may be left
            end_group(self.group, self.log)
        self.process = self.start()
        self.group = self.process.pid if own_group(self.process.pid) else None
        self.restart_at = None
        self.is_ready = False
        self.ready_at = None
        self.log(f"{self.name} pid {self.process.pid} (restarts so far: {self.restarts})")

    def poll(self, now: float) -> str | None:
        """Advance this service; an error message when it failed before it was ever ready."""
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.launch()
            return None
        code = self.process.poll()
        if code is None:
            if self.is_ready:
                self._check_health(now)
            elif self.ready(self.process):
                self.is_ready, self.ready_at = True, now
                if self.died_at is not None:
                    self.log(f"{self.name} serving again {now - self.died_at:.1f} s after it died")
                    self.died_at = None
                self.on_ready(self.restarts)
            return None
        if self.group is not None:
            end_group(self.group, self.log)
        if self.restarts == 0 and not self.is_ready and self.must_start:
            return f"{self.name} exited with {describe_exit(code)} before it was ready"
        stable = self.ready_at is not None and now - self.ready_at > STABLE_S
        self.delay_s = 0.0 if stable else min(MAX_BACKOFF_S, max(1.0, self.delay_s * 2))
        self.restarts += 1
        self.died_at = self.died_at or now
        self.restart_at = now + self.delay_s
        self.log(f"{self.name} died ({describe_exit(code)}); restart {self.restarts} in {self.delay_s:.0f} s")
        return None

    def _check_health(self, now: float) -> None:
        if self.healthy is None or now < self.next_health_check:
            return
        self.next_health_check = now + self.health_period_s
        self.num_unhealthy = 0 if self.healthy() else self.num_unhealthy + 1
        if self.num_unhealthy >= 2:
            self.log(f"{self.name} is running but cannot serve (its health check failed twice); killing it")
            self.num_unhealthy = 0
            self.process.kill()


def supervise(services: list[Service], restart: bool = True) -> int:
    """Run the services until a stop; 0 on a stop, else the exit code of the first one to fail for good."""
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for service in services:
        service.launch()
    code = 0
    while not stopping:
        now = time.monotonic()
        for service in services:
            if not restart and service.process.poll() is not None:
                code = service.process.returncode
                stopping = True
                break
            failure = service.poll(now)
            if failure is not None:
                service.log(failure)
                code, stopping = 1, True
                break
        time.sleep(0.2)
    end_all(services)
    return code


def end_all(services: list[Service]) -> None:
    """SIGTERM to every running service, then SIGKILL to each still there after its grace period.
    tritonserver does not exit on SIGTERM while a client keeps a gRPC stream open, even an idle one."""
    running = [s for s in services if s.process is not None and s.process.poll() is None]
    for service in running:
        service.process.terminate()
    since = time.monotonic()
    for service in running:
        try:
            service.process.wait(timeout=max(0.0, service.grace_s - (time.monotonic() - since)))
        except subprocess.TimeoutExpired:
            service.log(f"{service.name} still running {service.grace_s:.0f} s after SIGTERM (a client holds a "
                        "stream open?); killing it")
            service.process.kill()
            service.process.wait()
    for service in services:
        if service.group is not None:
            end_group(service.group, service.log)


def own_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def group_members(pgid: int) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process in the group, from /proc."""
    members = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()   # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid:
            members[int(entry.name)] = (int(fields[1]), fields[0])
    return members


def end_group(pgid: int, log: Callable[[str], None], timeout_s: float = GROUP_END_TIMEOUT_S) -> None:
    """SIGKILL to every process left in the group, then wait until none is left (zombies that are ours reaped;
    others' are gone but for their entry) and, on a GPU, until the device lists none of them."""
    left = group_members(pgid)
    if not left:
        return
    log(f"ending what is left of process group {pgid}: pids {sorted(left)}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid, (parent, state) in group_members(pgid).items():
            if state == "Z" and parent == os.getpid():
                os.waitpid(pid, os.WNOHANG)
        if all(state == "Z" for _, state in group_members(pgid).values()) and not holding_device(left):
            return
        time.sleep(0.05)
    log(f"process group {pgid} still holds {sorted(group_members(pgid))} after {timeout_s:.0f} s")


def holding_device(pids) -> bool:
    """Whether nvidia-smi lists any of these processes as using a GPU (False where there is no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(int(line) in pids for line in out.split() if line.strip().isdigit())


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"

"""The OpenMP runtime the CPU path runs its parallel ops on (torch, oneDNN and our extension share libgomp's).

Each parallel op ends in a barrier: a team is as fast as its slowest thread. On cores shared with other work (a
server's uploads, its client, another tenant) a worker that is waiting for a core holds up the whole team, and a
step of hundreds of ops slows down by far more than the CPU it lost. So the engine's team is sized to the cores
it gets (`TeamSizer`), work beside the steps runs on one thread (`one_openmp_thread`), and a thread whose parallel
work is done lets its workers go (`release_openmp_pool`). libgomp keeps these settings per thread.
"""
import ctypes
import os
import threading
import time
from contextlib import contextmanager
from functools import cache

import torch


@cache
def _libgomp():
    """The GNU OpenMP runtime torch runs its CPU ops on, or None (no OpenMP, another runtime, or too old to pause)."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        gomp = ctypes.CDLL("libgomp.so.1")
        return gomp if hasattr(gomp, "omp_pause_resource_all") else None
    except OSError:
        return None


def release_openmp_pool() -> None:
    """Let the calling thread's OpenMP workers exit (they come back with its next parallel op). libgomp keeps idle
    workers spinning only while it manages no more threads than the machine has CPUs; one pool more (a server's
    main thread, after it loaded the model or parsed an adapter) puts every worker to sleep after ~100 spins, and
    then each parallel op of the engine's steps waits for a wake-up (docs/performance.md, "Figures behind the
    code")."""
    gomp = _libgomp()
    if gomp is not None:
        gomp.omp_pause_resource_all(1)                   # omp_pause_soft: this thread's pool only, in libgomp


@contextmanager
def one_openmp_thread():
    """Run the calling thread's CPU ops on that thread alone, such as parsing an adapter upload beside the engine's
    steps: a team of its own would put more threads than cores into every barrier of the steps."""
    gomp = _libgomp()
    if gomp is None:
        yield
        return
    before = gomp.omp_get_max_threads()
    gomp.omp_set_num_threads(1)
    try:
        yield
    finally:
        gomp.omp_set_num_threads(before)


_kept = threading.local()                     # each thread's /proc files, open (closed with the thread's data)
os.register_at_fork(after_in_child=lambda: _kept.__dict__.clear())     # a child's thread is another task


def _read_proc(path: str, slot: str) -> bytes:
    """A /proc file's text from a descriptor kept open for the calling thread: one pread, a tenth of the cost of
    opening the file anew (a step on 2 cores reads two of them)."""
    file = getattr(_kept, slot, None)
    if file is None:
        file = open(path, "rb", buffering=0)
        setattr(_kept, slot, file)
    return os.pread(file.fileno(), 256, 0)


def _run_queue_wait_s() -> float | None:
    """Seconds the calling thread has spent ready to run but waiting for a core (Linux schedstat), or None."""
    try:
        return int(_read_proc("/proc/thread-self/schedstat", "schedstat").split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _idle_core_s() -> float | None:
    """Seconds the machine's cores have spent idle, added up over all of them (Linux /proc/uptime: the idle time of
    /proc/stat, without its I/O wait), or None."""
    try:
        return float(_read_proc("/proc/uptime", "uptime").split()[1])
    except (OSError, IndexError, ValueError):
        return None


class TeamSizer:
    """Sizes the stepping thread's OpenMP team to the cores it gets. Through each step (at checkpoints between
    layers, reading at most every `read_every_s`) it adds up how long the thread waited for a core; once the steps
    have run `interval_s`, a wait beyond `max_wait_fraction` of it means other work holds a core, and the team
    goes one thread smaller. After `hold_s` it tries one thread more; a try that waits again doubles the hold (up
    to `max_hold_s`), one that does not resets it. A smaller team does not wait out its hold when the machine's
    cores sat idle through its steps, `min_idle_cores` of them on average: the other work is gone, and it tries
    one thread more at once (unless such a try waited for cores that read idle, as under a CPU quota), so that a
    team is not held small after a burst of other work (adapter uploads) is over. What it gains is in
    docs/performance.md, "Figures behind the code". One stepping thread at a time: another one, or a team size set
    by someone else, starts it afresh."""

    def __init__(self, active: bool = True, max_wait_fraction: float = 0.2, interval_s: float = 0.2,
                 read_every_s: float = 0.02, hold_s: float = 1.0, max_hold_s: float = 30.0,
                 min_idle_cores: float = 0.5):
        self.max_wait_fraction = max_wait_fraction
        self.min_idle_cores = min_idle_cores
        self.interval_s = interval_s
        self.read_every_s = read_every_s             # a reading is two preads
        self.min_hold_s = hold_s
        self.max_hold_s = max_hold_s
        self.hold_s = hold_s
        self.max_threads = 0                          # the stepping thread's team size when it first came
        self.num_threads = 0
        self.num_reductions = 0
        self._thread = None
        self._held_until = 0.0
        self._trying = False
        self._trying_on_idle = False                  # the try came from idle cores, not from the hold's end
        self._trust_idle = True
        self._since = self._waited = 0.0              # the last reading: perf_counter() and run-queue wait
        self._idle = None                             # and the machine's idle core time
        self._window_s = self._window_wait_s = 0.0    # step time and waiting added up since the last judgement
        self._window_idle_s = 0.0
        self._gomp = _libgomp() if active and _run_queue_wait_s() is not None else None

    @property
    def active(self) -> bool:
        return self._gomp is not None

    def start(self) -> None:
        """A step begins: time between steps (idle, answering) is not counted."""
        if self._gomp is None:
            return
        team = self._gomp.omp_get_max_threads()
        if self._thread != threading.get_ident() or team != self.num_threads:    # a new thread, or a new setting
            self._thread = threading.get_ident()
            self.max_threads = self.num_threads = team
            self.hold_s, self._held_until, self._trying = self.min_hold_s, 0.0, False
            self._window_s = self._window_wait_s = self._window_idle_s = 0.0
        self._since, self._waited, self._idle = time.perf_counter(), _run_queue_wait_s(), _idle_core_s()

    def checkpoint(self) -> None:
        now = time.perf_counter()
        if self._gomp is None or now - self._since < self.read_every_s:
            return
        waited, idle = _run_queue_wait_s(), _idle_core_s()
        self._window_s += now - self._since
        self._window_wait_s += waited - self._waited
        if idle is not None and self._idle is not None:
            self._window_idle_s += idle - self._idle
        self._since, self._waited, self._idle = now, waited, idle
        if self._window_s >= self.interval_s:
            self._judge(self._window_wait_s > self.max_wait_fraction * self._window_s,
                        self._window_idle_s >= self.min_idle_cores * self._window_s)
            self._window_s = self._window_wait_s = self._window_idle_s = 0.0

    def _judge(self, crowded: bool, idle: bool) -> None:
        """crowded: the thread waited for a core beyond max_wait_fraction; idle: min_idle_cores sat idle."""
        if crowded and self.num_threads > 1:
            if self._trying:
                self.hold_s = min(2 * self.hold_s, self.max_hold_s)
            if self._trying_on_idle and idle:             # waiting for cores that read idle: not ours to get
                self._trust_idle = False
            self._set(self.num_threads - 1)
            self.num_reductions += 1
            self._held_until = time.monotonic() + self.hold_s
            self._trying = self._trying_on_idle = False
            return
        if self._trying:
            self.hold_s = self.min_hold_s
        self._trying = self._trying_on_idle = False
        if self.num_threads < self.max_threads:
            on_idle = idle and not crowded and self._trust_idle
            if on_idle or time.monotonic() >= self._held_until:
                self._set(self.num_threads + 1)
                self._trying, self._trying_on_idle = True, on_idle

    def _set(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._gomp.omp_set_num_threads(num_threads)

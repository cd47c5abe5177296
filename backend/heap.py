"""Gives the heap's free pages back to the system now and then: glibc's malloc_trim(0), every few seconds, on a
thread of its own.

A serving process parses multi-MB adapter uploads and frees them between blocks the engine keeps; glibc keeps the
freed pages between live blocks resident, so the engine's process grew for minutes under the soak (250-340 MB free
inside its arenas, ~+5% per 5 minutes) though what it held alive stayed flat. malloc_trim(0) hands back every
whole free page of every arena (each block stays where it is). It takes milliseconds to tens of milliseconds (one
madvise per free run), holding one arena's lock at a time: off the engine's thread, which only waits where it
allocates from the arena being trimmed. Without glibc this does nothing.

And keeps what a server starts with out of the cyclic garbage collector's passes (`freeze_heap`).
"""
import ctypes
import gc
import os
import threading
import time

TRIM_PERIOD_S = 10.0
PERIOD_VAR = "LORA_LLM_HEAP_TRIM_PERIOD_S"    # a server's period, in seconds (for tests: TRIM_PERIOD_S otherwise)


class HeapTrimmer:
    def __init__(self, period_s: float | None = None):
        period_s = float(os.environ.get(PERIOD_VAR, TRIM_PERIOD_S)) if period_s is None else period_s
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        try:
            self._malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):                  # not glibc
            self._malloc_trim = None
        self.period_s = period_s
        self.num_trims = 0
        self.max_trim_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._malloc_trim is not None

    def start(self) -> "HeapTrimmer":
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="heap-trimmer", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def trim(self) -> None:
        start = time.perf_counter()
        self._malloc_trim(0)
        self.max_trim_s = max(self.max_trim_s, time.perf_counter() - start)
        self.num_trims += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.trim()


def freeze_heap() -> None:
    """Everything alive now (an engine's start-up: modules, weights' wrappers, the imports; ~10^5-10^6 objects) out of
    the cyclic collector's passes from here on: a full pass over them stalls the stepping thread for several steps'
    worth of a small model's decode on a GPU (docs/performance.md, "Figures behind the code"). What serving
    allocates is collected as before."""
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    """Everything frozen back to the collector (an engine dropped after serving can then be freed whole)."""
    gc.unfreeze()

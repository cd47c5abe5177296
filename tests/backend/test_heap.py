"""backend/heap.py: the free pages between live heap blocks go back to the system, every period on a thread of
its own, which the engine loop starts and stops with itself."""
import subprocess
import sys
import time

import pytest

from backend import LLMEngine
from backend.heap import HeapTrimmer
from backend.serving.loop import EngineLoop
from tests.helpers import ROOT

needs_glibc = pytest.mark.skipif(not HeapTrimmer().available, reason="malloc_trim is glibc's")


FREED_BETWEEN_LIVE_BLOCKS = """
import re
from backend.heap import HeapTrimmer

def anon_rss_mb():
    return int(re.search(r"RssAnon:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) / 1024

blocks, kept = [], []
for _ in range(2048):
    blocks.append(bytearray(64 << 10))
    kept.append(bytes(600))
del blocks
freed = anon_rss_mb()
HeapTrimmer().trim()
print(freed, anon_rss_mb(), len(kept))
"""


@needs_glibc
def test_the_free_pages_between_live_blocks_go_back():
    """128 MB of 64 KiB blocks (heap blocks under glibc's mmap threshold), each followed by a small block that
    stays (past pymalloc's 512 bytes: a malloc block in between): freeing them keeps their pages resident, a trim
    gives them back. In a process of its own: a test worker's other threads (what earlier tests left) allocate
    beside it."""
    run = subprocess.run([sys.executable, "-c", FREED_BETWEEN_LIVE_BLOCKS], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    freed, trimmed, kept = run.stdout.split()
    assert float(trimmed) < float(freed) - 100 and int(kept) == 2048, run.stdout


@needs_glibc
def test_it_trims_every_period_until_stopped():
    trimmer = HeapTrimmer(period_s=0.05).start()
    time.sleep(0.4)
    trimmer.stop()
    num_trims = trimmer.num_trims
    assert num_trims >= 2 and trimmer.max_trim_s > 0
    time.sleep(0.2)
    assert trimmer.num_trims == num_trims
    with pytest.raises(ValueError, match="period_s"):
        HeapTrimmer(period_s=0)


@needs_glibc
def test_the_engine_loop_starts_and_stops_its_trimmer(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    loop = EngineLoop(engine, idle_wait_s=0.01)
    assert loop.heap._thread.is_alive()
    loop.stop()
    assert not loop.heap._thread.is_alive()

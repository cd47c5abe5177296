"""bench/server.py: the CPU tritonserver and its stubs use, read from /proc for a process and its children."""
import os
import subprocess
import sys

from bench.server import tree_cpu_seconds

BUSY = ("import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
        "print('done', flush=True)\ntime.sleep(60)")


def test_a_childs_cpu_counts_toward_its_parent_and_a_process_counts_only_its_own_tree():
    before = tree_cpu_seconds(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        assert tree_cpu_seconds(os.getpid()) - before >= 0.45       # the child's 0.5 s (its start-up on top)
        assert 0.45 <= tree_cpu_seconds(child.pid) < 5                # its own, not the machine's
    finally:
        child.kill()
        child.wait()

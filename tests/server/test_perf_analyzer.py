"""perf_analyzer 2.51 (from the tritonclient wheel) completes short streaming runs and reports a throughput."""
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora-weights"])
def test_perf_analyzer_reports_a_throughput(tiny_server, tiny_adapters, lora):
    cmd = [sys.executable, ROOT / "scripts" / "run_perf_analyzer.py", "--url", tiny_server.grpc_url,
           "--vocab-size", "512", "--requests", "8", "--concurrency", "2", "--output-len", "8"]
    if lora:
        cmd += ["--lora-task-id", "900", "--lora-dir", str(tiny_adapters[1])]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    match = re.search(r"Concurrency: 2, throughput: ([\d.]+) infer/sec", run.stdout)
    assert match and float(match.group(1)) > 0, run.stdout[-3000:]

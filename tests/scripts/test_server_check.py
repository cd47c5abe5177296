"""scripts/server_check.py (gpu_check.sh --server) on CPU: the real tritonserver streams the base model, an adapter
sent with its weights and the same adapter by id, and the tokens equal the in-process engine's; the script's GPU
run is the same code with --device cuda."""
import subprocess
import sys

from tests.helpers import ROOT


def test_the_server_check_passes_on_cpu():
    run = subprocess.run([sys.executable, ROOT / "scripts" / "server_check.py", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "server_check: passed" in run.stdout and "the adapter changes tokens: True" in run.stdout

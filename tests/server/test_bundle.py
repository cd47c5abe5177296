"""The server bundle for machines without network (scripts/pack_server.py): packed, unpacked into a folder of its
own, and scripts/gpu_check.sh --server run from it on this CPU (tiny-shape): tritonserver from the unpacked copy
streams the base model, LoRA and DoRA adapters with their weights and by id, a cancel, the ensemble's text, the
OpenAI API with an adapter by name and perf_analyzer, each checked against the engine in process; a SIGKILL under
the supervisor; W4 against W1."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def test_gpu_check_server_runs_from_the_unpacked_bundle(tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    bundle = tmp_path / f"server-py{version}.tar.xz"
    pack = subprocess.run([sys.executable, ROOT / "scripts" / "pack_server.py", "--python", version, "--level", "0",
                           "--out", bundle], capture_output=True, text=True, timeout=300)
    assert pack.returncode == 0, pack.stdout[-2000:] + pack.stderr[-2000:]
    env = os.environ | {"LORA_LLM_SERVER_BUNDLE_FILE": str(bundle), "TMPDIR": str(tmp_path), "PYTHON": sys.executable,
                        "GPU_CHECK_OUT": str(tmp_path), "GPU_CHECK_REPORT": str(tmp_path / "report.txt")}
    run = subprocess.run(["bash", ROOT / "scripts" / "gpu_check.sh", "--server"], env=env, capture_output=True,
                         text=True, timeout=600)
    report = (tmp_path / "report.txt").read_text()
    assert run.returncode == 0 and "gpu_check: passed" in report, report[-6000:]
    check = json.loads((tmp_path / "server_check_tiny-shape.json").read_text())
    assert check["tritonserver"].startswith(str(tmp_path / "lora_llm_server" / "server"))     # the unpacked copy
    assert check["passed"] and all(check["checks"].values()) and len(check["checks"]) == 11, check
    bench = json.loads((tmp_path / "server_bench_tiny-shape.json").read_text())["models"]["tiny-shape"]
    assert bench["W4"]["4"]["output_tokens"] == bench["W1"]["4"]["output_tokens"] == 8 * 64

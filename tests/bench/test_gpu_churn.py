"""bench/gpu_churn.py on CPU with the tiny shape: W5's churn bench's code path, its JSON and its lines, in
seconds."""
import json
import subprocess
import sys

from tests.helpers import ROOT


def test_gpu_churn_dry_run_on_cpu_writes_the_report(tmp_path):
    out = tmp_path / "churn.json"
    run = subprocess.run([sys.executable, ROOT / "bench" / "gpu_churn.py", "--device", "cpu", "--shape",
                          "tiny-shape", "--requests", "16", "--out", out], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {16, 64} == {int(rank) for rank in report["upload"]}
    assert report["upload"]["64"]["bytes"] == 4 * report["upload"]["16"]["bytes"] > 0
    assert report["W1"]["output_tokens"] == 16 * 64
    for tier in (8, 32):
        run_w5 = report[f"W5_tier_{tier}"]
        assert run_w5["output_tokens"] == 16 * 32 and run_w5["vs_W1"] > 0
        assert run_w5["device_loads"] >= 14                  # 16 requests on 16 adapters, 2 of them warm already
    beside = report["W5_tier_32"]["uploads_beside_decoding"]
    assert beside["step_ms_alone"] > 0 and beside["step_ms_with_uploads"] > 0 and beside["uploads"] == 20
    assert "uploads_beside_decoding" not in report["W5_tier_8"]

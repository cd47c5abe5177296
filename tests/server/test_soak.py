"""The soak's 30-second form on the tiny model: concurrent streams, adapter churn through 3 slots, cancellations,
preemption and adversarial requests; every request answered, no KV block or adapter pin left, engine alive."""
import json
import subprocess
import sys

from tests.helpers import ROOT


def test_thirty_second_soak_answers_everything_and_leaks_nothing(tiny_model_dir, tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, ROOT / "scripts" / "soak.py", "--streams", "12", "--duration", "30",
                          "--adapters", "16", "--max-loras", "3", "--kv-blocks", "12", "--max-prompt", "60",
                          "--max-output", "24", "--model-dir", tiny_model_dir, "--out", out],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests_sent"] == report["requests_answered"] > 50
    assert report["outcomes"]["finished"] > 0 and report["outcomes"]["cancelled by client"] > 0
    assert report["outcomes"]["error: invalid input"] > 0                      # NaN temperatures were refused
    assert report["kv_blocks_used"] == 0 and report["adapter_pins"] == 0 and report["engine_alive"] == 1
    assert report["restarts"] == 0 and report["host_adapter_bytes"] <= report["host_adapter_budget"]
    samples = report["server_rss_mb_samples"]                                  # memory every 10 s, from the start
    assert samples[0]["t"] <= 2 and samples[0]["stub lora_llm"] > 100 and samples[0]["tritonserver"] > 10
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples) and len(samples) >= 3

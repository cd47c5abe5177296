"""scripts/gpu_bench.py on CPU with the tiny shape: the GPU bench's code path, JSON and table, in seconds."""
import json
import os
import subprocess
import sys

from tests.helpers import ROOT


def test_gpu_bench_dry_run_on_cpu_writes_the_report(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, ROOT / "scripts" / "gpu_bench.py", "--device", "cpu", "--models",
                          "tiny-shape", "--requests", "3", "--curve-seqs", "8", "--curve-counts", "1,4,8",
                          "--out", out], capture_output=True, text=True, timeout=600,
                         env=os.environ | {"LORA_LLM_OVERLAP_STEPS": "true"})     # as on CUDA: W3 run ahead, in turn
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    r = report["models"]["tiny-shape"]
    assert report["device"] == "cpu" and r["time_to_ready_s"] > 0
    for name in ("W1", "W2", "W3", "W1_hf", "W2_hf", "W3_hf"):
        assert r[name]["tok_s"] > 0
    assert r["W1"]["output_tokens"] == r["W1_log_probs"]["output_tokens"] == 3 * 64 and r["W1_log_probs"]["vs_W1"] > 0
    assert r["W3"]["output_tokens"] == r["W3_in_turn"]["output_tokens"] == 128
    assert r["W3_own_engine"]["output_tokens"] == 128 and 0 < r["W3_own_engine"]["bandwidth_frac"]
    assert 0 < r["W3"]["bandwidth_frac"] and r["W3"]["itl_p50_s"] > 0
    assert "W1/HF" in run.stdout and "W3/in turn" in run.stdout and "W3 own" in run.stdout and "tiny-shape" in run.stdout
    for label, num_seqs in (("decode_profile_single", 1), ("decode_profile_base", 16), ("decode_profile_lora", 16)):
        assert r[label]["num_seqs"] == num_seqs and r[label]["step_ms_eager"] > 0, r[label]   # kernels: CUDA only
    lora = r["lora_kernels"]
    assert len(lora) == 4, lora
    for case in lora.values():
        assert set(case) == {"qkv", "o", "gate_up", "down", "layer"}
        assert all(case["layer"][k] > 0 for k in ("gpu_us", "host_us", "bound_us", "gemm_us", "in_turn_us",
                                                   "overlap_us", "gpu_us_other_expand"))
    curve = r["adapter_curve"]
    assert curve["num_seqs"] == 8 and curve["base_step_ms"] > 0 and not curve["kernel_fallbacks"], curve
    assert all(curve[f"{n} adapters"]["vs_base"] > 0 for n in (1, 4, 8)) and "distinct adapters" in run.stdout


def test_gpu_step_times_dry_run_on_cpu_prints_each_way(tmp_path):
    run = subprocess.run([sys.executable, ROOT / "bench" / "gpu_step_times.py", "--device", "cpu", "--shape",
                          "tiny-shape", "--profile"], capture_output=True, text=True, timeout=600,
                         env=os.environ | {"LORA_LLM_OVERLAP_STEPS": "true"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for label in ("one ahead, heap not frozen", "in turn, heap not frozen", "one ahead, heap frozen",
                  "in turn, heap frozen", "profiled"):
        assert f"{label}: " in run.stdout and "tok/s" in run.stdout, run.stdout
    assert run.stdout.count("  step ") == 3, run.stdout                     # the slowest steps' host calls

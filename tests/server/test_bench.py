"""scripts/bench.py end to end in a tiny form (every workload, the HF baselines, a real tritonserver for W4 and W7,
the plots), so that the one trusted way to measure the project cannot rot. Shapes only: speed lives in the figures."""
import json
import math
import subprocess
import sys

from tests.helpers import ROOT


def merged_every_answer(res: dict, num_requests: int) -> bool:
    """Through the server, a stub whose sends fall behind merges queued tokens into one response: on a loaded box
    every request may come back in one response, and there is no gap between responses to time."""
    return res.get("responses") == num_requests


def test_bench_all_workloads_quick(tiny_chat_model_dir, tmp_path):
    out, plots, num_requests = tmp_path / "results.json", tmp_path / "plots", 3
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--workload", "all", "--quick", "--requests",
           str(num_requests), "--model-dir", str(tiny_chat_model_dir), "--out", str(out), "--plot", str(plots)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["roofline_gflops"] > 0 and results["memory_gbps"] > 0 and results["machine"]
    assert results["roofline_after"]["roofline_gflops"] > 0 and results["roofline_after"]["memory_gbps"] > 0
    for name in ("W1", "W2", "W3", "W4", "W5", "W6", "W6_no_reuse", "W7", "W8", "W9", "W10"):
        res = results[name]
        assert res["tok_s"] > 0 and res["output_tokens"] > 0 and res["roofline_frac"] > 0, name
        assert res["ttft_p50_s"] > 0 and res["ttft_p99_s"] > 0, name
        for key in ("itl_p50_s", "itl_p99_s"):
            assert res[key] > 0 or (merged_every_answer(res, num_requests) and math.isnan(res[key])), (name, key)
        if name not in ("W4", "W6", "W6_no_reuse", "W7", "W8", "W9", "W10"):
            assert results[f"{name}_hf"]["tok_s"] > 0
    assert [p["concurrency"] for p in results["W1"]["sweep"]] == [1, 2]
    assert set(results["ratios"]) >= {"W1_over_hf", "W2_over_hf", "W1_over_W2", "W4_over_W1", "W3_bandwidth_frac",
                                      "W1_roofline_frac", "W6_ttft_p50_gain", "W6_kv_reuse_hit_rate", "W3_itl_over_W7",
                                      "W4_over_W1_decode_step", "W4_over_W1_prefill_s", "W9_over_W4", "W10_over_W8"}
    assert results["W9"]["frontend_cpu_seconds"] > 0
    assert results["W9"]["output_tokens"] == results["W4"]["output_tokens"]
    for name in ("W1", "W4"):                      # in process, and from the server's step histogram by kind
        res = results[name]
        assert res["num_decode_steps"] > 0 and res["num_prefill_steps"] > 0 and res["decode_step_mean_s"] > 0
        assert res["num_decode_steps"] + res["num_prefill_steps"] == res["steps"] and res["prefill_step_seconds"] > 0
    itl_unknown = merged_every_answer(results["W7"], num_requests)
    assert all(value > 0 for key, value in results["ratios"].items()
               if key != "W6_kv_reuse_hit_rate" and not (key == "W3_itl_over_W7" and itl_unknown))
    assert 0 <= results["ratios"]["W6_kv_reuse_hit_rate"] <= 1      # 3 requests: 3 adapters, nothing shared yet
    for png in ("throughput_vs_concurrency.png", "w4_latency_cdf.png", "w1_latency_cdf.png"):
        assert (plots / png).read_bytes()[:4] == b"\x89PNG"
    assert "W4_over_W1" in run.stdout


def test_bench_rounds_report_medians(tiny_model_dir, tmp_path):
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--workload", "W1,W2", "--requests", "2",
           "--repeat", "3", "--baseline", "none", "--model-dir", str(tiny_model_dir), "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    for name in ("W1", "W2"):
        assert len(results[name]["tok_s_rounds"]) == 3
        assert results[name]["tok_s"] == sorted(results[name]["tok_s_rounds"])[1]
    values = results["ratio_rounds"]["W1_over_W2"]
    assert len(values) == 3 and results["ratios"]["W1_over_W2"] == sorted(values)[1]
    assert "median of 3 rounds" in run.stdout
    order = [line[:2] for line in run.stdout.splitlines() if line.startswith(("W1:", "W2:"))]
    assert order == ["W1", "W2", "W2", "W1", "W1", "W2"]      # even rounds in reverse: drift falls on both

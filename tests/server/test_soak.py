"""The soak on the tiny model: concurrent streams, adapter churn through 3 slots, cancellations, preemption and
adversarial requests; every request answered, no KV block or adapter pin left, engine alive, and memory that stays
flat over the second half of two minutes of it. One soak serves the module: two minutes where the memory test is
selected, else 30 s."""
import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SOAK_ATTEMPTS = 3


def soak(model_dir, out, duration_s: int) -> dict:
    """The soak's report. One that tritonserver 2.51 ended by aborting in its own gRPC code (a known race between a
    client's cancel and its stream's final response, docs/reliability.md: every restart came with that abort's
    line), by the deadlock of its gRPC frontend (the stub's line that a call into tritonserver ran too long, then
    the supervisor's restart), or by its process dying of a fault signal (SIGSEGV, SIGABRT: our code runs in the
    stub's and the engine's processes) soaks again, up to SOAK_ATTEMPTS in all: what this module measures is our
    leaks, not those races (the deadlock came in two soaks in a row of one CI run, 2026-12-01). A request unanswered
    for 240 s ends the soak by itself (exit status 1 and its report: outcomes, restarts, aborts; the server stopped),
    well before this call's timeout, which would kill the soak and leave its server running."""
    for attempt in range(1, SOAK_ATTEMPTS + 1):
        out.unlink(missing_ok=True)
        run = subprocess.run([sys.executable, ROOT / "scripts" / "soak.py", "--streams", "12", "--duration",
                              str(duration_s), "--adapters", "16", "--max-loras", "3", "--kv-blocks", "12",
                              "--max-prompt", "60", "--max-output", "24", "--request-timeout", "240",
                              "--model-dir", model_dir, "--out", out],
                             capture_output=True, text=True, timeout=600 + duration_s)
        report = json.loads(out.read_text()) if out.exists() else {}
        if attempt < SOAK_ATTEMPTS and 0 < report.get("restarts", 0) <= len(report.get("upstream_aborts", [])):
            print(f"tritonserver 2.51 aborted in the soak ({report['upstream_aborts'][0]}): soaking again")
            continue
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-16000:]  # (the server's last lines, then why)
        return report


@pytest.fixture(scope="module")
def report(request, tiny_model_dir, tmp_path_factory) -> dict:
    long = any(item.name == test_two_minute_soak_keeps_memory_flat_over_its_second_half.__name__
               for item in request.session.items)
    return soak(tiny_model_dir, tmp_path_factory.mktemp("soak") / "soak.json", 120 if long else 30)


def test_the_soak_answers_everything_and_leaks_nothing(report):
    assert report["requests_sent"] == report["requests_answered"] > 50
    assert report["outcomes"]["finished"] > 0 and report["outcomes"]["cancelled by client"] > 0
    assert report["outcomes"]["error: invalid input"] > 0                      # NaN temperatures were refused
    assert report["kv_blocks_used"] == 0 and report["adapter_pins"] == 0 and report["engine_alive"] == 1
    assert report["restarts"] == 0 and report["host_adapter_bytes"] <= report["host_adapter_budget"]
    samples = report["server_rss_mb_samples"]                                  # memory every 10 s, from the start
    assert samples[0]["t"] <= 2 and samples[0]["stub lora_llm"] > 100 and samples[0]["tritonserver"] > 10
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples) and len(samples) >= 3


@pytest.mark.slow
def test_two_minute_soak_keeps_memory_flat_over_its_second_half(report):
    """The mean RSS of the last quarter of the load over that of a quarter around its middle: tritonserver less the
    adapter weights in flight (it holds each request's message until its final answer) grows by less than 5%, the
    engine's stub by less than 10%. (A leak of 1 MB a request, injected, gives the stub +49%. Without one, its warm-up
    on the tiny model ends within the first minute alone, +1.75-2.7% after it, but later on two cores shared with
    the rest of the suite: +5.1% and +5.3% in two fresh-clone runs, its RSS still rising 1 MB/s towards a plateau.)"""
    assert report["seconds"] >= 120
    growth = report["rss_growth_second_half"]
    assert {"stub lora_llm", "tritonserver_less_uploads_mb"} <= set(growth), growth
    assert growth["stub lora_llm"] < 0.10 and growth["tritonserver_less_uploads_mb"] < 0.05, growth

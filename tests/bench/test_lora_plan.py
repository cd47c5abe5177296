"""The LoRA cost plan (python -m bench.lora_plan): from the launchers' own configuration and the compiler's
occupancy, every case at the 8B shape moves at most 1.2x the bytes it must (its adapters, x and the output), and a
decode step's launches fit in 8 waves of a 132-SM GPU (what it guards against: the first kernels' launches of
tens of waves of programs that exit at once; on an H200 a decode expand of one 128-column tile a program, 4.5 waves,
ran 1.46x faster than groups of four tiles in 1.7 waves: bench/lora_sweep.py)."""
import json
import os
import subprocess
import sys

from tests.helpers import ROOT


def test_the_plan_stays_near_the_memory_bound_and_decode_launches_within_eight_waves(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "bench.lora_plan", "--json", str(tmp_path / "plan.json")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan) == 4
    for case, entry in plan.items():
        ratio = entry["total_bytes"] / entry["bound_bytes"]
        assert 1.0 <= ratio <= 1.2, (case, ratio)                  # no kernel moves less than it must read
        for name, projection in entry["projections"].items():
            assert projection["shrink"]["blocks_per_sm"] >= 1 and projection["expand"]["blocks_per_sm"] >= 1
            if case.startswith("decode"):
                for kernel in ("shrink", "expand"):
                    assert projection[kernel]["waves"] <= 8, (case, name, kernel, projection[kernel]["waves"])
    assert "2 launches per projection" in run.stdout


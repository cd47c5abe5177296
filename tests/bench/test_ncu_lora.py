"""bench/ncu_lora.py: ncu's raw CSV page (as `--csv --page raw --print-units base` prints it after the profiled
program's own output) read into one labelled row per launch, the worst stall reasons first; and on a GPU with
Nsight Compute, the whole run."""
import json
import shutil
import subprocess
import sys

import pytest

from bench import ncu_lora
from tests.helpers import ROOT, needs_cuda


def raw_page(rows: list[dict]) -> str:
    names = ["ID", "Process ID", "Kernel Name"] + list(ncu_lora.METRICS.values()) + \
        [ncu_lora.STALL_METRIC.format(reason) for reason in ncu_lora.STALLS]
    units = ["", "", ""] + ["nsecond", "%", "byte", "%", "%", "register/thread"] + ["inst"] * len(ncu_lora.STALLS)
    lines = [",".join(f'"{n}"' for n in names), ",".join(f'"{u}"' for u in units)]
    for i, row in enumerate(rows):
        values = [str(i), "77", row["kernel"]] + [row[name] for name in ncu_lora.METRICS] + \
            [row.get(reason, "0.1") for reason in ncu_lora.STALLS]
        lines.append(",".join(f'"{v}"' for v in values))
    return "==PROF== Connected to process 77\nthe child's own output\n" + "\n".join(lines) + "\n"


def test_the_raw_page_becomes_a_labelled_row_per_launch():
    page = raw_page([
        dict(kernel="_shrink_kernel", ns="12,500", dram_pct="41.5", dram_read_bytes="25000000", occupancy_pct="30.1",
             theoretical_pct="50", registers="96", long_scoreboard="9.5", wait="1.2"),
        dict(kernel="_expand_kernel", ns="8000", dram_pct="70", dram_read_bytes="32000000", occupancy_pct="45",
             theoretical_pct="50", registers="64", lg_throttle="3.0", barrier="n/a")])
    rows = ncu_lora.parse(page, ["qkv shrink", "qkv expand, rows (planned)"])
    assert [r["launch"] for r in rows] == ["qkv shrink", "qkv expand, rows (planned)"]
    assert rows[0]["ns"] == 12500 and rows[0]["registers"] == 96 and rows[1]["dram_pct"] == 70
    assert list(rows[0]["stalls"]) == ["long_scoreboard", "wait", "short_scoreboard"]
    assert list(rows[1]["stalls"])[0] == "lg_throttle"
    table = ncu_lora.table(rows)
    assert "| qkv shrink | 12.5 | 42 | 2000 | 30 / 50 | 96 | long_scoreboard 9.5" in table
    with pytest.raises(SystemExit, match="measured 2 launches, the child made 3"):
        ncu_lora.parse(page, ["a", "b", "c"])


@needs_cuda
@pytest.mark.skipif(shutil.which("ncu") is None, reason="needs Nsight Compute (ncu) on PATH")
def test_the_lora_kernels_under_ncu(tmp_path):
    out = tmp_path / "ncu.json"
    run = subprocess.run([sys.executable, ROOT / "bench" / "ncu_lora.py", "--shape", "smollm2-135m-shape", "--out",
                          out], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    launches = json.loads(out.read_text())["launches"]
    assert len(launches) == 4 * 5 and all(r["ns"] > 0 and r["registers"] > 0 for r in launches)

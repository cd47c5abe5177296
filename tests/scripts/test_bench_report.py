"""scripts/bench_report.py: the warning when the machine's own speed moved during a bench run."""
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from bench_report import print_drift                          # noqa: E402


@pytest.mark.parametrize("gflops_after,gbps_after,warned", [(120, 26, False), (108, 23, False), (77, 26, True),
                                                              (120, 15, True), (150, 26, True)])
def test_a_run_whose_probes_moved_past_15_percent_is_flagged(capsys, gflops_after, gbps_after, warned):
    print_drift({"roofline_gflops": 122.0, "memory_gbps": 26.1,
                 "roofline_after": {"roofline_gflops": gflops_after, "memory_gbps": gbps_after}})
    out = capsys.readouterr().out
    assert ("WARNING: this machine's speed changed during the run" in out) == warned
    assert not warned or f"matmul 122 -> {gflops_after} GFLOP/s, copy 26.1 -> {gbps_after:.1f} GB/s" in out

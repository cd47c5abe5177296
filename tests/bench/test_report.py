"""bench/report.py: the warning when the machine's own speed moved during a bench run, and rounds of a
run (--repeat) combined."""
import pytest

from bench.report import combine_rounds, median_ratios, print_drift


@pytest.mark.parametrize("gflops_after,gbps_after,warned", [(120, 26, False), (108, 23, False), (77, 26, True),
                                                              (120, 15, True), (150, 26, True)])
def test_a_run_whose_probes_moved_past_15_percent_is_flagged(capsys, gflops_after, gbps_after, warned):
    print_drift({"roofline_gflops": 122.0, "memory_gbps": 26.1,
                 "roofline_after": {"roofline_gflops": gflops_after, "memory_gbps": gbps_after}})
    out = capsys.readouterr().out
    assert ("WARNING: this machine's speed changed during the run" in out) == warned
    assert not warned or f"matmul 122 -> {gflops_after} GFLOP/s, copy 26.1 -> {gbps_after:.1f} GB/s" in out


def test_rounds_keep_each_workloads_median_run_and_each_ratio_per_round():
    def run(tok_s: float) -> dict:
        return {"tok_s": tok_s, "roofline_frac": tok_s / 100}
    rounds = [{"W1": run(10), "W2": run(20)}, {"W1": run(30), "W2": run(30)}, {"W1": run(20), "W2": run(40)}]
    chosen, per_round = combine_rounds(rounds)
    assert chosen["W1"]["tok_s"] == 20 and chosen["W2"]["tok_s"] == 30
    assert chosen["W1"]["tok_s_rounds"] == [10, 30, 20]
    assert per_round["W1_over_W2"] == [0.5, 1.0, 0.5]              # a ratio within each round, not across them
    assert per_round["W1_roofline_frac"] == [0.1, 0.3, 0.2]
    combined = median_ratios(chosen | {"W1_hf": {"tok_s": 5.0}}, per_round)
    assert combined["W1_over_W2"] == 0.5 and combined["W1_roofline_frac"] == 0.2
    assert combined["W1_over_hf"] == 4.0                            # baselines run once: against the median run
    two = combine_rounds(rounds[:2])[0]
    assert two["W1"]["tok_s"] == 10                                 # an even count keeps the lower median run

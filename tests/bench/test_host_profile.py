"""bench/host_profile.py (scripts/bench.py --host-profile): every stage of a decode step timed, and with detail the
outputs stage split by function, on a real engine over the tiny model."""
from bench.host_profile import DETAIL_STAGES, HOST_STAGES, host_profile


def test_the_host_profile_times_each_stage_and_splits_the_outputs_on_request():
    plain, detailed = (host_profile(num_steps=4, num_rounds=1, cases=((2, 16),), detail=detail)["cases"][0]
                       for detail in (False, True))
    on_cpu = ("graph_step", "replay")                                  # CUDA graphs only
    assert all(plain[stage] > 0 for stage in HOST_STAGES if stage != "sampling_inputs")   # (greedy rows: none)
    assert not any(stage in plain for stage in DETAIL_STAGES)
    assert all(detailed[stage] > 0 for stage in DETAIL_STAGES if stage not in on_cpu)
    for case in (plain, detailed):
        assert (case["num_seqs"], case["context"]) == (2, 16) and 0 < case["host_ms"] < case["step_ms"]


def test_a_cached_forward_runs_the_model_once_for_each_number_of_rows(monkeypatch):
    import pytest
    from backend.model.llama import LlamaModel
    calls = []
    real = LlamaModel.forward
    monkeypatch.setattr(LlamaModel, "forward", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    result = host_profile(num_steps=4, num_rounds=2, cases=((2, 16),), forward="cached", evict_mb=1)
    case = result["cases"][0]
    assert (result["forward"], result["evict_mb"]) == ("cached", 1) and 0 < case["host_ms"] < case["step_ms"]
    assert len(calls) <= 4                                # prefill rows, then decode rows: never again per step
    with pytest.raises(ValueError, match="forward"):
        host_profile(cases=((1, 16),), forward="stub")
    with pytest.raises(ValueError, match="evict_mb"):
        host_profile(cases=((1, 16),), evict_mb=32)


def test_the_churn_profile_times_every_step_until_its_sequences_end():
    result = host_profile(num_steps=4, num_rounds=2, cases=((3, 16),), churn=True, forward="cached")
    case = result["cases"][0]
    assert result["churn"] and 0 < case["inputs"] and 0 < case["host_ms"] < case["step_ms"]

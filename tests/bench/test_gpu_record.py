"""bench/gpu_record.py: each figure's latest run per GPU, and docs/bench/gpu.json as it makes it."""
import json

from bench import gpu_record
from bench.gpu_record import Run, record


def test_a_later_run_replaces_a_figure_per_gpu_and_ratios_come_from_one_run(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"models": {"m": {"W1": {"tok_s": 100.0}, "W3": {"itl_p50_s": 0.005},
                                                               "time_to_ready_s": 9.0}}}))
    (tmp_path / "b.json").write_text(json.dumps({"run": {"models": {"m": {"W1": {"tok_s": 120.0}}}}}))
    (tmp_path / "c.json").write_text(json.dumps({"models": {"m": {"W1": {"16": {"tok_s": 50.0}},
                                                                  "W4": {"16": {"tok_s": 40.0}}}}}))
    runs = [Run("a.json", "H200", "d1", "c1", "models"), Run("b.json", "H200", "d2", "c2", "run/models"),
            Run("c.json", "H200", "d3", "c3", "models"), Run("b.json", "H100", "d2", "c2", "run/models"),
            Run("a.json", "H200", "d4", "c4", "models", weights="int8")]
    got = record(runs, tmp_path)
    h200 = got["H200"]["m"]
    assert h200["W1"] == {"value": 120.0, "unit": "tokens/s", "date": "d2", "commit": "c2", "file": "b.json"}
    assert h200["W3"]["value"] == 5.0 and h200["W3"]["commit"] == "c1"            # ms: none later
    assert h200["W4/W1 at 16 streams"]["value"] == 0.8 and h200["W4/W1 at 16 streams"]["file"] == "c.json"
    assert set(got["H100"]["m"]) == {"W1"} and got["H200"]["m, int8 weights"]["W1"]["value"] == 100.0


def test_the_stored_record_is_what_the_run_files_give():
    stored = json.loads(gpu_record.OUT.read_text())
    assert stored["figures"] == record()
    assert stored["figures"]["NVIDIA H200"]["llama-3.1-8b-shape"]["W1"]["commit"] == "a8e76b4"

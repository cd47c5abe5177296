"""bench/lora_sweep.py as a dry run on CPU (the kernels through the interpreter, a small grid): the default
configuration comes first, every configuration's result is checked against the default's, a group that would
straddle two bands is not tried, and a result that differs is never reported as the best."""
import math

from bench import lora_sweep


def test_a_dry_sweep_checks_every_configuration_against_the_default(monkeypatch):
    monkeypatch.setattr(lora_sweep, "SHRINK", {"block_k": (32,), "num_warps": (4,), "num_stages": (2,)})
    monkeypatch.setattr(lora_sweep, "SPLITS", (1, 3))
    monkeypatch.setattr(lora_sweep, "EXPAND", {"mma": (True, False), "block_n": (32, 64), "tiles": (1, 2),
                                               "num_warps": (4,), "num_stages": (2,)})
    case = lora_sweep.build("tiny-shape", ["decode"], "cpu", copies=False)["decode"]
    results = {"cases": {"decode": {}}}
    for proj in ("qkv", "o"):
        rows = lora_sweep.sweep_projection(case, proj, deadline=math.inf)
        results["cases"]["decode"][proj] = rows
        shrink_default, expand_default = lora_sweep.default_configs(case.projs[proj]["launch"])
        assert {k: rows["shrink"][0][k] for k in shrink_default} == shrink_default
        assert {k: rows["expand"][0][k] for k in expand_default} == expand_default
        assert len(rows["shrink"]) == 1 + 2 and "cut" not in rows
        for entry in rows["shrink"] + rows["expand"]:
            assert "failed" not in entry and entry["us"] > 0 and entry["error"] < 0.01, (proj, entry)
        groups = {entry["block_n"] * entry["tiles"] for entry in rows["expand"][1:]}
        widths = case.projs[proj]["widths"]
        assert groups == {g for g in (32, 64, 128) if all(w % g == 0 for w in widths)}, (proj, widths)
    assert case.projs["qkv"]["widths"] == [128, 64, 64]                 # (so its groups stop at 64)
    assert any("layer" in line for line in lora_sweep.report(results))

    o = case.projs["o"]
    o["default_out"] = o["base"].clone()                                        # as if the default had added nothing
    rows = lora_sweep.sweep_projection(case, "o", deadline=math.inf)
    assert all(entry["error"] > 0.03 for entry in rows["expand"])
    assert lora_sweep.best(rows["expand"]) is None

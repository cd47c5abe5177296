"""The ratios a benchmark run reports (with the targets of issue 6 beside them) and its one printed table."""
import math
import statistics

TARGETS = {"W1_over_hf": 20.0, "W2_over_hf": 8.0, "W1_over_W2": 0.8, "W4_over_W1": 0.9, "W3_bandwidth_frac": 0.5,
           "W1_roofline_frac": 0.10, "W1_over_vllm": 5.0, "W2_over_vllm": 1.0, "W3_over_vllm": 1.0,
           "W3_itl_over_W7": 0.9, "W9_over_W4": 0.9, "W10_over_W8": 0.9}


def ratios(results: dict) -> dict:
    out = {}
    for name in ("W1", "W2", "W3", "W5", "W6"):
        for base in ("hf", "vllm"):
            if name in results and f"{name}_{base}" in results:
                out[f"{name}_over_{base}"] = results[name]["tok_s"] / results[f"{name}_{base}"]["tok_s"]
    for a, b in (("W1", "W2"), ("W4", "W1"), ("W9", "W4"), ("W10", "W8")):
        if a in results and b in results:
            out[f"{a}_over_{b}"] = results[a]["tok_s"] / results[b]["tok_s"]
    if "W4" in results and "W1" in results:             # where the server's time goes: decode steps, prefill steps
        out["W4_over_W1_decode_step"] = results["W1"]["decode_step_mean_s"] / results["W4"]["decode_step_mean_s"]
        out["W4_over_W1_prefill_s"] = results["W1"]["prefill_step_seconds"] / results["W4"]["prefill_step_seconds"]
    if "W3" in results:
        out["W3_bandwidth_frac"] = results["W3"]["bandwidth_frac"]
    if "W3" in results and "W7" in results:             # single-stream ITL in process over through the server
        out["W3_itl_over_W7"] = results["W3"]["itl_p50_s"] / results["W7"]["itl_p50_s"]
    if "W6" in results and "W6_no_reuse" in results:
        out["W6_ttft_p50_gain"] = results["W6_no_reuse"]["ttft_p50_s"] / results["W6"]["ttft_p50_s"]
        out["W6_kv_reuse_hit_rate"] = results["W6"]["kv_reuse_hit_rate"]
    for name in ("W1", "W2"):
        if name in results:
            out[f"{name}_roofline_frac"] = results[name]["roofline_frac"]
    return out


def combine_rounds(rounds: list[dict]) -> tuple[dict, dict]:
    """Rounds of the same workloads, run one after another (W1, W4, then W4, W1, ...) so that a shared host's
    drift falls on every workload: each workload's median run by tok/s (the lower one of an even count) with every
    round's tok/s beside it, and each ratio between our own workloads as its value per round."""
    chosen = {}
    for name in rounds[0]:
        runs = sorted((r[name] for r in rounds), key=lambda res: res["tok_s"])
        chosen[name] = runs[(len(runs) - 1) // 2] | {"tok_s_rounds": [r[name]["tok_s"] for r in rounds]}
    per_round = [ratios(r) for r in rounds]
    return chosen, {key: [r[key] for r in per_round] for key in per_round[0]}


def median_ratios(results: dict, rounds: dict) -> dict:
    """The run's ratios, those measured in every round taken as their median over the rounds."""
    return ratios(results) | {key: statistics.median(values) for key, values in rounds.items()}


def _tok_s(base: dict | None) -> str:
    return f"{base['tok_s']:.1f}" if base else "-"


def _times(res: dict, base: dict | None) -> str:
    return f"{res['tok_s'] / base['tok_s']:.2f}" if base else "-"


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{1000 * value:.0f}"


def print_table(results: dict, names: list[str]) -> None:
    print(f"\n{results['machine']}; matmul {results['roofline_gflops']:.0f} GFLOP/s, "
          f"copy {results['memory_gbps']:.1f} GB/s")
    print(f"{'':12} {'reqs':>4} {'tok/s':>8} {'HF tok/s':>9} {'x HF':>6} {'vLLM tok/s':>10} {'x vLLM':>6} "
          f"{'roofline':>8} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15}")
    for name in names:
        res, hf, vllm = results[name], results.get(f"{name}_hf"), results.get(f"{name}_vllm")
        print(f"{name:12} {res['requests']:4d} {res['tok_s']:8.1f} {_tok_s(hf):>9} {_times(res, hf):>6} "
              f"{_tok_s(vllm):>10} {_times(res, vllm):>6} {100 * res['roofline_frac']:7.1f}% "
              f"{_ms(res.get('ttft_p50_s')) + '/' + _ms(res.get('ttft_p99_s')):>16} "
              f"{_ms(res.get('itl_p50_s')) + '/' + _ms(res.get('itl_p99_s')):>15}")
    rounds = results.get("ratio_rounds", {})
    for key, value in results["ratios"].items():
        target, values = TARGETS.get(key), rounds.get(key, [])
        print(f"  {key:18} {value:7.2f}" + (f"   (target >= {target}, {'met' if value >= target else 'missed'})"
                                            if target else "")
              + (f"   median of {len(values)} rounds, {min(values):.2f}-{max(values):.2f}" if len(values) > 1 else ""))


def print_drift(results: dict, tolerance: float = 0.15) -> None:
    """Warn when the machine itself got faster or slower during the run (a shared host): the probes, measured
    again at the end, moved by more than `tolerance`, so figures from different workloads compare badly."""
    after = results["roofline_after"]
    moved = {key: after[key] / results[key] for key in ("roofline_gflops", "memory_gbps")}
    if any(abs(ratio - 1) > tolerance for ratio in moved.values()):
        print(f"WARNING: this machine's speed changed during the run (matmul {results['roofline_gflops']:.0f} -> "
              f"{after['roofline_gflops']:.0f} GFLOP/s, copy {results['memory_gbps']:.1f} -> "
              f"{after['memory_gbps']:.1f} GB/s): ratios between workloads of this run are unreliable")

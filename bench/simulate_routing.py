"""LoRA routing at scale, simulated (bench/routing.py): replicas x device slots x host tier, thousands of adapters with
Zipf popularity, Poisson requests; round-robin, adapter-affinity hashing, and affinity with least-load spill-over,
at 8, 64 and 512 replicas. Prints the device-tier hit rate, TTFT p50/p99 and load imbalance, writes JSON and a plot.

    python bench/simulate_routing.py                          # costs from docs/bench/routing_costs.json
    python bench/simulate_routing.py --measure                # measure the costs on this machine first (~1 min)
    python bench/simulate_routing.py --replicas 8,64 --adapters 2000 --out /tmp/sim.json --plot /tmp/sim.png
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.routing import Costs, Scenario, requests, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COSTS = ROOT / "docs" / "bench" / "routing_costs.json"
POLICIES = ("round-robin", "affinity", "affinity-spill")
UPLOAD_S_PER_BYTE = 3.0 / 426e6               # W4: 16 adapters' 426 MB took ~3 core-s from client to the engine's
                                              # host tier (docs/performance.md); the parse is measured apart


def measure_costs(model_dir: str, rank: int = 16) -> dict:
    """Decode steps over rows and distinct adapters (fitted), prompt tokens, and an adapter's host and device costs,
    on the default model in this process."""
    import numpy as np
    import torch

    from backend import LLMEngine
    from backend.lora.peft import load_lora_dir
    from bench.adapters import adapter_dirs
    from bench.roofline import cpu_name
    dirs = adapter_dirs(model_dir, (rank,) * 16)
    engine = LLMEngine(model_dir, max_loras=16, max_num_seqs=64, kv_cache_memory_bytes=512 << 20)
    weights, config = load_lora_dir(dirs[0])
    parse_s = []
    for task_id, path in enumerate(dirs, start=1):
        w, c = load_lora_dir(path)
        start = time.perf_counter()
        engine.lora_cache.insert(task_id, engine.lora_cache.parse(w.astype(np.float16), c))
        parse_s.append(time.perf_counter() - start)
    load_s = []
    for task_id in range(1, 9):
        start = time.perf_counter()
        engine.lora_cache._load(task_id, task_id - 1)
        load_s.append(time.perf_counter() - start)

    def decode_step(rows: int, adapters: int) -> float:
        ids = [engine.add_request([5] * 32, lora=1 + i % adapters if adapters else None, max_new_tokens=40,
                                  ignore_end_id=True) for i in range(rows)]
        while engine.num_steps == 0 or engine.last_step_kind != "decode":
            engine.step()
        times = []
        for _ in range(6):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        for request_id in ids:
            engine.abort(request_id)
        return statistics.median(times)

    grid = [(b, k, decode_step(b, k)) for b in (1, 8, 32) for k in (0, 1, 8, 16) if k <= b]
    features = np.array([[1, b, k > 0, b * (k > 0), k] for b, k, _ in grid], dtype=float)
    fit = np.linalg.lstsq(features, np.array([t for *_, t in grid]), rcond=None)[0]
    ids = [engine.add_request([7] * 128, max_new_tokens=2) for _ in range(16)]
    start = time.perf_counter()
    engine.step()
    prefill_token_s = (time.perf_counter() - start) / (16 * 128)
    for request_id in ids:
        engine.abort(request_id)
    adapter_bytes = weights.size * 2
    costs = Costs(*(max(0.0, float(v)) for v in fit), prefill_token_s=prefill_token_s,
                  host_upload_s=statistics.median(parse_s) + adapter_bytes * UPLOAD_S_PER_BYTE,
                  device_load_s=statistics.median(load_s))
    return {"costs": asdict(costs), "rank": rank, "adapter_bytes": adapter_bytes, "dtype": str(engine.runner.dtype),
            "decode_steps_s": grid, "parse_s": statistics.median(parse_s),
            "machine": f"{platform.machine()} {cpu_name()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "model": Path(model_dir).name,
            "assumed": {"upload_s_per_byte": UPLOAD_S_PER_BYTE}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help=f"measure the costs first (writes {COSTS.name})")
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--replicas", default="8,64,512")
    parser.add_argument("--adapters", type=int, default=5000)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second per replica")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--host-adapters", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "routing_sim.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench" / "routing_sim.png")
    args = parser.parse_args()
    if args.measure:
        COSTS.write_text(json.dumps(measure_costs(args.model_dir), indent=1))
    measured = json.loads(COSTS.read_text())
    costs = Costs(**measured["costs"])
    print(f"costs ({COSTS.name}, {measured['model']} {measured['dtype']} on {measured['machine']}): "
          + ", ".join(f"{k} {1e3 * v:.3g} ms" for k, v in asdict(costs).items()), flush=True)
    results = {"costs": measured, "scenarios": {}}
    print(f"{'replicas':>8} {'policy':>15} {'requests':>9} {'device hit':>10} {'host hit':>9} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'imbalance':>9}")
    for num_replicas in (int(n) for n in args.replicas.split(",")):
        scenario = Scenario(num_replicas, args.adapters, args.zipf, args.rate, args.duration,
                            max_loras=args.max_loras, host_adapters=args.host_adapters)
        reqs = requests(scenario)
        for policy in POLICIES:
            res = simulate(scenario, policy, costs, reqs)
            results["scenarios"][f"{num_replicas}/{policy}"] = res | {"scenario": asdict(scenario)}
            print(f"{num_replicas:8d} {policy:>15} {res['requests']:9d} {res['device_hit_rate']:10.2f} "
                  f"{res['host_hit_rate']:9.2f} {res['ttft_p50_s']:8.2f}s {res['ttft_p99_s']:8.2f}s "
                  f"{res['load_imbalance']:9.2f}", flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.plot)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = sorted({int(key.split("/")[0]) for key in results["scenarios"]})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for policy in POLICIES:
        rows = [results["scenarios"][f"{n}/{policy}"] for n in sizes]
        for ax, key, label in zip(axes, ("device_hit_rate", "ttft_p99_s", "load_imbalance"),
                                  ("device-tier hit rate", "TTFT p99 (s)", "load imbalance (max / mean)")):
            ax.plot(sizes, [r[key] for r in rows], marker="o", label=policy)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("replicas")
            ax.set_title(label)
    axes[1].set_yscale("log")
    axes[0].legend()
    costs = results["costs"]
    fig.suptitle(f"Routing simulation, costs measured on {costs['model']} {costs['dtype']} ({costs['machine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot in {path}")


if __name__ == "__main__":
    main()

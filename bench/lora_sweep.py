"""The LoRA kernels' launch configurations swept on a GPU: for each case and projection of one layer at a model shape
(bench/lora_kernels.py's adapters and cases), the GPU time of the shrink and of the expand alone at each
configuration (tiles, splits, warps, pipeline stages), each result checked against the default configuration's.
Times come from a CUDA-graph replay whose calls cycle through copies of the adapters larger than twice the L2, so
each call reads its adapters from memory as a step's layers do. The configurations compile first in parallel
processes (they fill Triton's cache), then are timed one by one here. What plan_launch's rules are chosen from.

    python bench/lora_sweep.py [--shape llama-3.1-8b-shape] [--cases decode,64,256] [--out lora_sweep.json]
"""
import argparse
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.lora.slots import PROJS, DeviceSlots, proj_shape                       # noqa: E402
from backend.model.checkpoint import ModelConfig                                          # noqa: E402
from backend.model.self_check import random_adapter                                 # noqa: E402
from bench.lora_kernels import CASES, RANKS                                         # noqa: E402
from bench.step_profile import sync                                                 # noqa: E402
from kernels.dispatch import load_ops                                               # noqa: E402
from kernels.lora.triton_kernels import lora_expand, lora_shrink, prepare_launch    # noqa: E402
from scripts.gpu_bench import SHAPES                                                # noqa: E402

CASE_KEYS = {"decode": "decode, 16 tokens over 16 adapters", "64": "64 tokens over 16 adapters",
             "256": "256 tokens over 16 adapters", "one": "decode, 16 tokens on one rank-64 adapter"}
SHRINK = {"block_k": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
SPLITS = (1, 2, 4, 8, 16, 32, 64)
EXPAND = {"mma": (True, False), "block_n": (32, 64, 128, 256), "tiles": (1, 2, 4, 8), "num_warps": (2, 4, 8),
          "num_stages": (2, 3)}
L2_BYTES = 60 << 20
CALLS = 24                                    # calls a timed graph holds


def grid(space: dict) -> list[dict]:
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


class Case:
    """One case's projections: inputs, the default launch, the adapters' copies (device), the default results."""

    def __init__(self, cfg: ModelConfig, slots: DeviceSlots, ops, per_slot: list[int], device: str, copies: bool):
        token_slots = [slot for slot, n in enumerate(per_slot) for _ in range(n)]
        self.num_tokens = len(token_slots)
        self.projs = {}
        g = torch.Generator(device=device).manual_seed(1)
        for proj in PROJS:
            in_dim, out_dim = proj_shape(cfg, proj)
            segments = ops.lora.segments(token_slots, torch.bfloat16)
            segments.use({name: t.to(device) for name, t in segments.tensors.items()})
            step_lora = ops.lora_for(segments, slots)
            projection = slots.projections[0][proj]
            x = torch.randn(self.num_tokens, in_dim, device=device, dtype=torch.bfloat16, generator=g)
            base = torch.randn(self.num_tokens, out_dim, device=device, dtype=torch.bfloat16, generator=g)
            out = base.clone()
            step_lora.apply(x, projection, out)                           # the default: plans the step
            prepared = step_lora.prepare(x, projection)
            per_copy = projection.a.nbytes + projection.b.nbytes
            num_copies = max(2, math.ceil(2 * L2_BYTES / per_copy)) if copies else 1
            views = [projection] + [replace(projection, a=projection.a.clone(), b=projection.b.clone())
                                    for _ in range(num_copies - 1)]
            self.projs[proj] = dict(x=x, base=base, default_out=out, prepared=prepared, launch=prepared.launch,
                                    partials=prepared.partials, widths=projection.widths, views=views)
            self.projs[proj]["h"] = self.shrink(proj, default_configs(prepared.launch)[0])   # (zero where unset)

    def shrink(self, proj: str, config: dict, view: int = 0, h: torch.Tensor | None = None) -> torch.Tensor:
        """One shrink at `config` ({block_k, split_k, num_warps, num_stages}) into h (a new zeroed one)."""
        p, view_proj = self.projs[proj], self.projs[proj]["views"][view]
        k_blocks = math.ceil(p["launch"].in_dim / config["block_k"])
        per_split = math.ceil(k_blocks / min(config["split_k"], k_blocks))
        launch = replace(p["launch"], block_k=config["block_k"], split_k=math.ceil(k_blocks / per_split),
                         blocks_per_split=per_split)
        cap = view_proj.a.shape[1]
        if h is None:
            h = torch.zeros(self.num_tokens, cap, dtype=view_proj.a.dtype, device=view_proj.a.device)
        part = p.setdefault(("part", launch.split_k), torch.empty(launch.split_k, self.num_tokens, cap,
                                                                  dtype=torch.float32, device=h.device))
        prepared = prepare_launch(launch, view_proj, p["prepared"].work, p["prepared"].counters, h, part)
        prepared.shrink_kwargs |= {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
        return lora_shrink(p["x"], view_proj, prepared)

    def expand(self, proj: str, config: dict, out: torch.Tensor, view: int = 0) -> None:
        """One expand at `config` ({mma, block_n, tiles, num_warps, num_stages}) adding into out."""
        p, view_proj = self.projs[proj], self.projs[proj]["views"][view]
        launch = replace(p["launch"], mma=config["mma"], block_n=config["block_n"], tiles=config["tiles"])
        prepared = prepare_launch(launch, view_proj, p["prepared"].work, p["prepared"].counters, p["h"],
                                  p["partials"])
        prepared.expand_kwargs |= {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
        lora_expand(p["h"], view_proj, prepared, out)


def expand_configs(p: dict) -> list[dict]:
    """The expand grid's configurations whose group divides every band's width (a group never straddles two bands)
    and whose B tile holds <= 16K values."""
    return [c for c in grid(EXPAND) if all(w % (c["block_n"] * c["tiles"]) == 0 for w in p["widths"])
            and c["block_n"] * p["launch"].block_r <= 16384]


def default_configs(launch) -> tuple[dict, dict]:
    return ({"block_k": launch.block_k, "split_k": launch.split_k, **launch.shrink_options},
            {"mma": launch.mma, "block_n": launch.block_n, "tiles": launch.tiles, **launch.expand_options})


def build(shape: str, cases: list[str], device: str, copies: bool) -> dict[str, Case]:
    cfg = replace(ModelConfig.from_hf(SHAPES[shape]), num_layers=1)
    ops = load_ops("triton", device)
    slots = DeviceSlots(cfg, len(RANKS), max(RANKS), torch.bfloat16, device, ops.lora)
    g = torch.Generator().manual_seed(0)
    for slot, rank in enumerate(RANKS):
        slots.load(slot, random_adapter(cfg, rank, torch.bfloat16, g))
    slots.copies.wait(list(range(len(RANKS))))
    return {case: Case(cfg, slots, ops, CASES[CASE_KEYS[case]], device, copies) for case in cases}


def shrink_configs(launch) -> list[dict]:
    """The shrink grid's configurations whose A tile holds <= 16K values, each at every split count."""
    compiled = [c for c in grid(SHRINK) if launch.block_c * c["block_k"] <= 16384]
    return [c | {"split_k": s} for c in compiled for s in SPLITS]


def compile_share(shape: str, cases: list[str], device: str, share: int, num_shares: int) -> int:
    """Launch every num_shares-th configuration once (Triton's cache keeps what it compiled)."""
    built, count = build(shape, cases, device, copies=False), 0
    for case in built.values():
        for proj in PROJS:
            p = case.projs[proj]
            todo = [("shrink", c) for c in shrink_configs(p["launch"]) if c["split_k"] == 2] + \
                   [("expand", c) for c in expand_configs(p)]
            for kind, config in todo[share::num_shares]:
                try:
                    if kind == "shrink":
                        case.shrink(proj, config)
                    else:
                        case.expand(proj, config, case.projs[proj]["base"].clone())
                    count += 1
                except Exception:                                 # reported when timed
                    pass
    sync(device)
    return count


def replay_us(fn, num_views: int) -> float:
    """Microseconds a call: CALLS calls (cycling through the adapters' copies) in one CUDA graph, replayed (on CPU,
    a dry run: one eager call)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn(0)
        return (time.perf_counter() - start) * 1e6
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i % num_views)
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / (3 * CALLS)


def close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest value."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def sweep_projection(case: Case, proj: str, deadline: float) -> dict:
    """The shrink's and the expand's configurations (the default first), each checked and timed until `deadline`."""
    p = case.projs[proj]
    launch, num_views = p["launch"], len(p["views"])
    default_shrink, default_expand = default_configs(launch)
    h_scratch, out = torch.zeros_like(p["h"]), p["base"].clone()
    rows = {"launch": {k: getattr(launch, k) for k in ("num_items", "num_bands", "in_dim", "out_dim", "block_m",
                                                        "block_r", "block_k", "split_k", "block_n", "tiles", "mma")}}

    def expanded(config: dict) -> torch.Tensor:
        got = p["base"].clone()
        case.expand(proj, config, got)
        return got

    for kind, configs, result, want, timed in (
            ("shrink", [default_shrink] + shrink_configs(launch), lambda c: case.shrink(proj, c), p["h"],
             lambda c: lambda v: case.shrink(proj, c, v, h_scratch)),
            ("expand", [default_expand] + expand_configs(p), expanded, p["default_out"],
             lambda c: lambda v: case.expand(proj, c, out, v))):
        rows[kind] = []
        for config in configs:
            if time.monotonic() > deadline:
                rows["cut"] = True
                break
            entry = dict(config)
            try:
                entry["error"] = close(result(config), want)
                entry["us"] = replay_us(timed(config), num_views)
            except Exception as err:
                entry["failed"] = f"{type(err).__name__}: {str(err)[:200]}"
            rows[kind].append(entry)
    return rows


def best(entries: list[dict], tolerance: float = 0.03) -> dict | None:
    ok = [e for e in entries if "us" in e and e["error"] <= tolerance]
    return min(ok, key=lambda e: e["us"]) if ok else None


def report(results: dict) -> list[str]:
    lines = []
    for case, projs in results["cases"].items():
        lines.append(f"{CASE_KEYS[case]}: us (default -> best, its configuration)")
        totals = [0.0, 0.0]
        for proj, rows in projs.items():
            for kind in ("shrink", "expand"):
                default, top = rows[kind][0] if rows[kind] else None, best(rows[kind])
                if default is None or "us" not in default or top is None:
                    lines.append(f"  {proj:8s} {kind:6s} no result")
                    continue
                totals[0] += default["us"]
                totals[1] += top["us"]
                config = {k: v for k, v in top.items() if k not in ("us", "error")}
                lines.append(f"  {proj:8s} {kind:6s} {default['us']:7.1f} -> {top['us']:7.1f}  {config}")
        lines.append(f"  layer           {totals[0]:7.1f} -> {totals[1]:7.1f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b-shape", choices=list(SHAPES))
    parser.add_argument("--cases", default="decode,64,256")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop timing after this many seconds")
    parser.add_argument("--out", type=Path, default=Path("lora_sweep.json"))
    args = parser.parse_args()
    started, cases = time.monotonic(), args.cases.split(",")
    if args.jobs > 1:
        import multiprocessing
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            counts = list(pool.map(compile_share, *zip(*[(args.shape, cases, args.device, i, args.jobs)
                                                         for i in range(args.jobs)])))
        print(f"compiled {sum(counts)} launches in {args.jobs} processes, {time.monotonic() - started:.0f} s",
              flush=True)
    built = build(args.shape, cases, args.device, copies=True)
    deadline = started + args.budget_s
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (a dry run)"
    results = {"shape": args.shape, "device": device_name, "torch": torch.__version__,
               "calls": CALLS, "cases": {}}
    for case_name, case in built.items():
        results["cases"][case_name] = {}
        for proj in PROJS:
            results["cases"][case_name][proj] = sweep_projection(case, proj, deadline)
            args.out.write_text(json.dumps(results, indent=1))
            print(f"{case_name} {proj}: {time.monotonic() - started:.0f} s", flush=True)
    print("\n".join(report(results)), flush=True)


if __name__ == "__main__":
    main()

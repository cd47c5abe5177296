"""The LoRA kernels' cost plan at the Llama-3.1-8B shape, from the launchers' own configuration (kernels/lora/launch.py:
plan_launch, the work list a CUDA graph of the step holds) and what the compiler reports for it (registers and
shared memory -> programs per SM on a 132-SM H100/H200): per case and projection, the programs of each launch,
the bytes each reads and writes (the loads the kernels issue, masks honoured), the waves, and the totals against
the bound (the adapter bytes the step uses + x + the output, read and written once).

    python -m bench.lora_plan [--json FILE] [--occupancy N]
--occupancy N assumes N programs per SM instead of compiling (no compiler needed, for a quick look).
"""
import argparse
import json
import os
from dataclasses import asdict, dataclass

from kernels.lora.launch import LoraLaunch, block_m_for, max_work_items, plan_launch, work_items

NUM_SMS = 132                                 # H100 SXM and H200
MAX_RANK, NUM_SLOTS = 64, 16                  # W1's adapters: ranks 8/16/32/64 cycling, max_loras 16
ELT = 2                                       # bf16 activations and adapters
HIDDEN, INTER, Q, KV = 4096, 14336, 4096, 1024
PROJECTIONS = {"qkv": (HIDDEN, [Q, KV, KV]), "o": (Q, [HIDDEN]), "gate_up": (HIDDEN, [INTER, INTER]),
               "down": (INTER, [HIDDEN])}
RANKS = [8, 16, 32, 64] * 4                   # slot -> rank, every module
CASES = {                                     # name -> (tokens per slot, graph bucket), slots in order
    "decode, 16 tokens over 16 adapters": ([1] * 16, 16),
    "64 tokens over 16 adapters": ([4] * 16, 64),
    "256 tokens over 16 adapters": ([16] * 16, 256),
    "decode, 16 tokens on one rank-64 adapter": ([0, 0, 0, 16] + [0] * 12, 16),
}
DECODE_CASES = ("decode, 16 tokens over 16 adapters", "decode, 16 tokens on one rank-64 adapter")


@dataclass
class LaunchCost:
    kernel: str
    programs: int                             # the grid
    active: int                               # programs with work (the others exit after their metadata)
    bytes_per_program_mean: float             # over active programs
    bytes_per_program_max: int
    total_bytes: int                          # every program, idle ones included
    blocks_per_sm: int
    waves: float


def launch_args(launch: LoraLaunch, num_tokens: int, act: str = "*bf16", weight: str = "*bf16",
                delta: bool = False) -> tuple[dict, dict, dict]:
    """The runtime arguments (pointer types and ints, as the launchers pass them) of a projection's shrink, expand
    (delta: into the fp32 delta) and merge, for compiling them ahead of time: slots stored as on a GPU ([slot, cap,
    in] and [slot, out, cap])."""
    cap, ints = launch.num_bands * launch.max_rank, "*i32"
    shrink = dict(x_ptr=act, a_ptr=weight, h_ptr=act, part_ptr="*fp32", count_ptr=ints, work_ptr=ints,
                  ranks_ptr=ints, stride_xt=launch.in_dim, in_dim=launch.in_dim, max_rank=launch.max_rank,
                  split_k=launch.split_k, blocks_per_split=launch.blocks_per_split, stride_as=cap * launch.in_dim,
                  stride_ar=launch.in_dim, stride_ak=1, stride_rb=NUM_SLOTS, stride_ht=cap,
                  stride_ps=num_tokens * cap, stride_pt=cap)
    target = "*fp32" if delta else act
    expand = dict(h_ptr=act, b_ptr=weight, out_ptr=target, delta_ptr=target, work_ptr=ints, ranks_ptr=ints,
                  bounds_ptr=ints, m_ptr=weight, stride_ot=launch.out_dim, stride_dt=launch.out_dim,
                  max_rank=launch.max_rank, stride_ht=cap, stride_bs=launch.out_dim * cap, stride_bn=cap, stride_bk=1,
                  stride_rb=NUM_SLOTS, stride_bounds=launch.num_bands + 1, stride_ms=launch.out_dim)
    merge = dict(delta_ptr="*fp32", out_ptr=act, work_ptr=ints, ranks_ptr=ints, bounds_ptr=ints, m_ptr=weight,
                 stride_ot=launch.out_dim, stride_dt=launch.out_dim, stride_rb=NUM_SLOTS,
                 stride_bounds=launch.num_bands + 1, stride_ms=launch.out_dim)
    return shrink, expand, merge


def occupancy(launch: LoraLaunch, num_tokens: int, cc: int = 90) -> tuple[int, int]:
    """Programs per SM of the shrink and the expand, from ptxas's registers and the compiler's shared memory."""
    from kernels.aot import compile_kernel, resources
    shrink, expand, _ = launch_args(launch, num_tokens)
    blocks = []
    for kernel, args, constexprs, options in (
            ("_shrink_kernel", shrink, launch.shrink_constexprs, launch.shrink_options),
            ("_expand_kernel", expand, launch.expand_constexprs | {"DELTA": False}, launch.expand_options)):
        compiled = compile_kernel("kernels.lora.triton_kernels", kernel, args, constexprs | {"DOT_FP32": False}, cc,
                                  options)
        blocks.append(resources(compiled, cc)["blocks_per_sm"])
    return blocks[0], blocks[1]


def shrink_costs(launch: LoraLaunch, items: list[tuple[int, int, int]], ranks: list[int]) -> list[int]:
    """Bytes each shrink program moves: metadata, x and A over its split's columns, its partial (or h), and the
    last split's reduction."""
    costs = []
    for slot, start, end in items:
        for split in range(launch.split_k):
            meta = 3 * 4 + launch.num_bands * 4
            if slot < 0:
                costs.append(3 * 4)
                continue
            rows, rank = end - start, ranks[slot]
            columns = max(0, min(launch.k_per_split, launch.in_dim - split * launch.k_per_split))
            moved = meta + rows * columns * ELT + launch.num_bands * rank * columns * ELT
            out = rows * launch.num_bands * rank
            if launch.split_k == 1:
                moved += out * ELT
            else:
                moved += out * 4 + 8                                   # the partial, the counter
                if split == launch.split_k - 1:                        # the last: every partial back, h out
                    moved += launch.split_k * out * 4 + out * ELT + 4
            costs.append(moved)
    return costs


def expand_costs(launch: LoraLaunch, widths: list[int], items: list[tuple[int, int, int]],
                 ranks: list[int]) -> list[int]:
    """Bytes each expand program moves: metadata, h, its B tile at the rank, its output tile read and written, and
    the slot's DoRA magnitudes for its columns."""
    bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
    costs = []
    group = launch.block_n * launch.tiles
    tiles = [(band, first) for band in range(len(widths)) for first in range(bounds[band], bounds[band + 1], group)]
    for slot, start, end in items:
        for band, first in tiles:
            if slot < 0:
                costs.append(3 * 4)
                continue
            rows, rank, cols = end - start, ranks[slot], min(group, bounds[band + 1] - first)
            meta = 3 * 4 + launch.num_bands * 3 * 4
            costs.append(meta + rows * rank * ELT + cols * rank * ELT + 2 * rows * cols * ELT + cols * ELT)
    return costs


def cost(kernel: str, costs: list[int], blocks_per_sm: int) -> LaunchCost:
    active = [c for c in costs if c > 3 * 4]
    return LaunchCost(kernel, len(costs), len(active), sum(active) / max(1, len(active)), max(active, default=0),
                      sum(costs), blocks_per_sm, len(costs) / (NUM_SMS * blocks_per_sm))


def plan(occupancy_override: int | None = None) -> dict:
    """{case: {projection: {"shrink": LaunchCost, "expand": LaunchCost, "bound_bytes"}, "total_bytes",
    "bound_bytes"}}"""
    out = {}
    occupancies: dict[tuple, tuple[int, int]] = {}
    for case, (per_slot, bucket) in CASES.items():
        starts, slots = [0], []
        for slot, n in enumerate(per_slot):
            if n:
                slots.append(slot)
                starts.append(starts[-1] + n)
        num_tokens, block_m = starts[-1], block_m_for(bucket)
        num_items = max_work_items(bucket, NUM_SLOTS + 2, block_m)     # the graph's fixed work list
        items = work_items(starts, slots, block_m, num_items).tolist()
        ranks = [r if n else 0 for r, n in zip(RANKS, per_slot)]
        row = {}
        for name, (in_dim, widths) in PROJECTIONS.items():
            launch = plan_launch(bucket, num_items, in_dim, widths, MAX_RANK, block_m)
            key = (tuple(launch.shrink_constexprs.items()), tuple(launch.expand_constexprs.items()), in_dim)
            if key not in occupancies:
                occupancies[key] = (occupancy_override,) * 2 if occupancy_override else occupancy(launch, bucket)
            shrink_blocks, expand_blocks = occupancies[key]
            adapter = sum(ranks[s] * (in_dim + sum(widths)) * ELT + (len(widths) - 1) * ranks[s] * in_dim * ELT
                          for s in set(slots))
            bound = adapter + num_tokens * in_dim * ELT + 2 * num_tokens * sum(widths) * ELT
            row[name] = {"launch": asdict(launch), "shrink": cost("shrink", shrink_costs(launch, items, ranks),
                                                                  shrink_blocks),
                         "expand": cost("expand", expand_costs(launch, widths, items, ranks), expand_blocks),
                         "bound_bytes": bound}
        total = sum(p["shrink"].total_bytes + p["expand"].total_bytes for p in row.values())
        out[case] = {"projections": row, "total_bytes": total,
                     "bound_bytes": sum(p["bound_bytes"] for p in row.values())}
    return out


def print_plan(result: dict) -> None:
    print(f"LoRA cost plan, Llama-3.1-8B shape, bf16, max_lora_rank {MAX_RANK}, {NUM_SLOTS} slots, one layer, "
          f"{NUM_SMS} SMs; 2 launches per projection")
    for case, entry in result.items():
        print(f"\n{case}")
        print(f"  {'proj':8s} {'kernel':7s} {'programs':>8s} {'active':>7s} {'B/program mean':>15s} "
              f"{'max':>8s} {'per SM':>6s} {'waves':>6s} {'bytes':>10s} {'bound':>10s}")
        for name, p in entry["projections"].items():
            for kernel in ("shrink", "expand"):
                c = p[kernel]
                bound = f"{p['bound_bytes']:>10,d}" if kernel == "shrink" else ""
                print(f"  {name:8s} {kernel:7s} {c.programs:8d} {c.active:7d} {c.bytes_per_program_mean:15,.0f} "
                      f"{c.bytes_per_program_max:8,d} {c.blocks_per_sm:6d} {c.waves:6.2f} {c.total_bytes:10,d} "
                      f"{bound}")
        ratio = entry["total_bytes"] / entry["bound_bytes"]
        print(f"  total {entry['total_bytes']:,d} bytes against the bound's {entry['bound_bytes']:,d}: {ratio:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the plan here")
    parser.add_argument("--occupancy", type=int, help="programs per SM to assume instead of compiling")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1" and not args.occupancy:
        raise SystemExit("the plan compiles the kernels: run it without TRITON_INTERPRET (or pass --occupancy)")
    result = plan(args.occupancy)
    print_plan(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({case: {**entry, "projections": {name: {k: asdict(v) if isinstance(v, LaunchCost) else v
                                                              for k, v in p.items()}
                                                       for name, p in entry["projections"].items()}}
                       for case, entry in result.items()}, f, indent=1)


if __name__ == "__main__":
    main()

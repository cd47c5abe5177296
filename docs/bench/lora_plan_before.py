"""The cost plan of the LoRA kernels as they were before issue 49 (commit 7457908), by the accounting of
bench/lora_plan.py: the same cases at the 8B shape, the old kernels' grids and loads, their occupancy from
compiling the old source. For docs/performance.md's before/after table.

    python docs/bench/lora_plan_before.py        (from the repository root, in git, without TRITON_INTERPRET)
"""
import importlib
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kernels.aot import compile_kernel, resources                                  # noqa: E402
from bench.lora_plan import CASES, ELT, MAX_RANK, NUM_SLOTS, NUM_SMS, PROJECTIONS, RANKS  # noqa: E402

COMMIT = "7457908"
SEGMENTS = NUM_SLOTS + 2                      # a graph's segments then: base rows, one per slot, padding


def old_module():
    """kernels/lora.py at COMMIT, importable as `old_lora`."""
    source = subprocess.run(["git", "show", f"{COMMIT}:kernels/lora.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    folder = Path(tempfile.mkdtemp())
    (folder / "old_lora.py").write_text(source)
    sys.path.insert(0, str(folder))
    return importlib.import_module("old_lora")


def occupancy(old, in_dim: int, widths: list[int], bucket: int) -> tuple[int, int, dict, dict]:
    cap, out_dim = len(widths) * MAX_RANK, sum(widths)
    shrink_cfg = old.shrink_config(in_dim, bucket) | {"DOT_FP32": False}
    expand_cfg = old.expand_config() | {"SPLIT_K": shrink_cfg["SPLIT_K"], "DOT_FP32": False}
    seg = dict(seg_starts_ptr="*i32", seg_slots_ptr="*i32", ranks_ptr="*i32")
    shrink = dict(x_ptr="*bf16", a_ptr="*bf16", h_ptr="*fp32") | seg | dict(
        in_dim=in_dim, cap=cap, max_rank=MAX_RANK, stride_xt=in_dim, stride_as=cap * in_dim, stride_ar=in_dim,
        stride_ak=1, stride_rb=NUM_SLOTS, stride_hs=bucket * cap, stride_ht=cap)
    expand = dict(h_ptr="*fp32", b_ptr="*bf16", out_ptr="*bf16") | seg | dict(
        bounds_ptr="*i32", max_rank=MAX_RANK, num_n_blocks=64, stride_hs=bucket * cap, stride_ht=cap,
        stride_bs=out_dim * cap, stride_bn=cap, stride_bk=1, stride_rb=NUM_SLOTS, stride_ot=out_dim)
    blocks = [resources(compile_kernel("old_lora", k, a, c, 90), 90)["blocks_per_sm"]
              for k, a, c in (("_shrink_kernel", shrink, shrink_cfg), ("_expand_kernel", expand, expand_cfg))]
    return blocks[0], blocks[1], shrink_cfg, expand_cfg


def case_costs(old, per_slot: list[int], bucket: int) -> dict:
    segments = [(slot, n) for slot, n in enumerate(per_slot) if n]
    ranks = [r if n else 0 for r, n in zip(RANKS, per_slot)]
    m_blocks = math.ceil(bucket / 16)
    out, total_bytes, total_bound = {}, 0, 0
    for name, (in_dim, widths) in PROJECTIONS.items():
        s_blocks, e_blocks, scfg, ecfg = occupancy(old, in_dim, widths, bucket)
        split, bands, cap = scfg["SPLIT_K"], len(widths), len(widths) * MAX_RANK
        k_split = math.ceil(math.ceil(in_dim / scfg["BLOCK_K"]) / split) * scfg["BLOCK_K"]
        shrink, expand = [], []
        n_blocks = math.ceil(max(widths) / ecfg["BLOCK_N"])
        for s in range(SEGMENTS):
            slot, rows = segments[s] if s < len(segments) else (-1, 0)
            for m in range(m_blocks):
                m_rows = max(0, min(16, rows - 16 * m))
                for r_block in range(math.ceil(cap / 16)):
                    for sp in range(split):
                        if slot < 0 or m_rows == 0:
                            shrink.append(12)
                            continue
                        valid = max(0, min(16, ranks[slot] - (r_block * 16) % MAX_RANK))
                        cols = max(0, min(k_split, in_dim - sp * k_split))
                        shrink.append(12 + 16 * 4 + (m_rows * cols * ELT + valid * cols * ELT + m_rows * valid * 4
                                                     if valid else 0))
                for band in range(bands):
                    for nb in range(n_blocks):
                        width = widths[band] - nb * ecfg["BLOCK_N"]
                        if slot < 0 or m_rows == 0 or width <= 0 or not ranks[slot]:
                            expand.append(12 + (12 if slot >= 0 and m_rows else 0))
                            continue
                        n = min(ecfg["BLOCK_N"], width)
                        steps = math.ceil(ranks[slot] / 16)
                        expand.append(24 + steps * (split * m_rows * 16 * 4 + n * 16 * ELT) + 2 * m_rows * n * ELT)
        tokens = sum(per_slot)
        adapter = sum(ranks[s] * (in_dim * bands + sum(widths)) * ELT for s, _ in segments)
        bound = adapter + tokens * in_dim * ELT + 2 * tokens * sum(widths) * ELT
        out[name] = [(kernel, len(c), sum(1 for x in c if x > 24), sum(c), blocks, len(c) / (NUM_SMS * blocks))
                     for kernel, c, blocks in (("shrink", shrink, s_blocks), ("expand", expand, e_blocks))]
        total_bytes += sum(sum(c) for c in (shrink, expand))
        total_bound += bound
    return {"projections": out, "total_bytes": total_bytes, "bound_bytes": total_bound}


def main() -> None:
    old = old_module()
    print(f"LoRA cost plan of the kernels at {COMMIT} (before issue 49), Llama-3.1-8B shape, bf16, one layer")
    for case, (per_slot, bucket) in CASES.items():
        entry = case_costs(old, per_slot, bucket)
        print(f"\n{case}\n  {'proj':8s} {'kernel':7s} {'programs':>8s} {'active':>7s} {'per SM':>6s} {'waves':>7s} "
              f"{'bytes':>12s}")
        for name, rows in entry["projections"].items():
            for kernel, programs, active, moved, blocks, waves in rows:
                print(f"  {name:8s} {kernel:7s} {programs:8d} {active:7d} {blocks:6d} {waves:7.2f} {moved:12,d}")
        print(f"  total {entry['total_bytes']:,d} bytes against the bound's {entry['bound_bytes']:,d}: "
              f"{entry['total_bytes'] / entry['bound_bytes']:.3f}x")


if __name__ == "__main__":
    main()

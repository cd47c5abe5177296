"""The LoRA kernels under Nsight Compute at one case of one layer (bench/lora_kernels.py's adapters and cases): per
projection its shrink, its expand both ways (tensor cores, rows one by one), the expand into the fp32 delta and the
merge, each launch's GPU time, DRAM throughput (% of peak, and bytes read), achieved and theoretical occupancy,
registers, and the warp stall reasons that cost most (cycles a warp waits per instruction issued). Prints a
Markdown table (docs/performance.md keeps it) and writes JSON.

    python bench/ncu_lora.py [--shape llama-3.1-8b-shape] [--case decode] [--out ncu_lora.json] [--ncu PATH]
It runs itself under `ncu --clock-control none --profile-from-start off`: the child launches every kernel once to
compile and warm it, then once more inside cudaProfilerStart/Stop, the launches ncu measures.
"""
import argparse
import csv
import glob
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METRICS = {"ns": "gpu__time_duration.sum", "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "dram_read_bytes": "dram__bytes_read.sum",
           "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
           "theoretical_pct": "sm__maximum_warps_per_active_cycle_pct", "registers": "launch__registers_per_thread"}
STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "membar", "mio_throttle", "lg_throttle", "wait",
          "math_pipe_throttle", "not_selected", "no_instruction", "branch_resolving", "dispatch_stall", "drain",
          "imc_miss", "sleeping")
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
CASE_KEYS = {"decode": "decode, 16 tokens over 16 adapters", "64": "64 tokens over 16 adapters",
             "256": "256 tokens over 16 adapters", "one": "decode, 16 tokens on one rank-64 adapter"}


def child(shape: str, case: str, labels_path: Path) -> None:
    """Every launch once warm, then once between cudaProfilerStart and Stop; their labels, in order, to a file."""
    import torch

    from backend.model.checkpoint import ModelConfig
    from backend.lora.slots import PROJS, proj_shape
    from bench.lora_kernels import CASES, layer_slots
    from kernels.dispatch import load_ops
    from kernels.lora.triton_kernels import lora_expand, lora_merge, lora_shrink
    from scripts.gpu_bench import SHAPES
    ops = load_ops("triton", "cuda")
    cfg, slots = layer_slots(ModelConfig.from_hf(SHAPES[shape]), ops, "cuda")
    token_slots = [slot for slot, n in enumerate(CASES[CASE_KEYS[case]]) for _ in range(n)]
    launches = []
    for proj in PROJS:
        in_dim, out_dim = proj_shape(cfg, proj)
        segments = ops.lora.segments(token_slots, torch.bfloat16)
        segments.use({name: t.to("cuda") for name, t in segments.tensors.items()})
        segments.overlap = True                                         # a step with the delta, as a graph's
        step_lora = ops.lora_for(segments, slots)
        x = torch.randn(len(token_slots), in_dim, device="cuda", dtype=torch.bfloat16)
        out = torch.randn(len(token_slots), out_dim, device="cuda", dtype=torch.bfloat16)
        projection = slots.projections[0][proj]
        step_lora.apply(x, projection, out)                             # plans the step
        planned = step_lora.prepare(x, projection)
        other = step_lora.relaunched(projection, mma=not planned.launch.mma)
        way = {True: "tensor cores", False: "rows"}

        def expand(prepared, into=out, projection=projection, planned=planned):
            lora_expand(planned.h, projection, prepared, into)
        launches += [(f"{proj} shrink", lambda x=x, p=projection, pl=planned: lora_shrink(x, p, pl)),
                     (f"{proj} expand, {way[planned.launch.mma]} (planned)", lambda e=expand: e(planned)),
                     (f"{proj} expand, {way[other.launch.mma]}", lambda e=expand, o=other: e(o)),
                     (f"{proj} expand into the delta", lambda e=expand: e(planned, None)),
                     (f"{proj} merge", lambda p=projection, pl=planned, o=out: lora_merge(p, pl, o))]
    for _, launch in launches:                                          # compiled and warm
        launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _, launch in launches:
        launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    labels_path.write_text(json.dumps([label for label, _ in launches]))


def find_ncu(given: str | None) -> str:
    found = given or shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)
    if not found:
        raise SystemExit("ncu_lora: no ncu on PATH or under /opt/nvidia/nsight-compute (pass --ncu)")
    return found


def parse(stdout: str, labels: list[str]) -> list[dict]:
    """ncu's raw CSV page (a header row, a units row, a row a launch, base units) -> a row a launch, labelled."""
    lines = stdout[stdout.index('"ID"'):].splitlines()
    header, _units, *rows = list(csv.reader(lines))
    if len(rows) != len(labels):
        raise SystemExit(f"ncu_lora: ncu measured {len(rows)} launches, the child made {len(labels)}")
    def number(text: str) -> float:
        return float(text.replace(",", "")) if text.strip() not in ("", "n/a") else float("nan")
    result = []
    for label, row in zip(labels, rows):
        values = dict(zip(header, row))
        entry = {"launch": label, "kernel": values.get("Kernel Name", "")}
        entry |= {name: number(values[metric]) for name, metric in METRICS.items()}
        stalls = {reason: number(values[STALL_METRIC.format(reason)]) for reason in STALLS}
        stalls = {reason: cycles for reason, cycles in stalls.items() if cycles == cycles}     # not n/a
        entry["stalls"] = dict(sorted(stalls.items(), key=lambda item: -item[1])[:3])
        result.append(entry)
    return result


def table(rows: list[dict]) -> str:
    lines = ["| launch | us | DRAM % of peak | DRAM read GB/s | occupancy % (achieved / theoretical) | registers | "
             "top stalls (cycles per issue) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        stalls = ", ".join(f"{name} {cycles:.1f}" for name, cycles in r["stalls"].items())
        lines.append(f"| {r['launch']} | {r['ns'] / 1e3:.1f} | {r['dram_pct']:.0f} | "
                     f"{r['dram_read_bytes'] / r['ns']:.0f} | {r['occupancy_pct']:.0f} / {r['theoretical_pct']:.0f} "
                     f"| {r['registers']:.0f} | {stalls} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b-shape")
    parser.add_argument("--case", default="decode", choices=list(CASE_KEYS))
    parser.add_argument("--out", type=Path, default=Path("ncu_lora.json"))
    parser.add_argument("--ncu", help="the ncu binary (default: on PATH, or under /opt/nvidia/nsight-compute)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)          # the labels' file
    args = parser.parse_args()
    if args.child:
        child(args.shape, args.case, args.child)
        return
    labels_path = args.out.with_suffix(".labels.json")
    metrics = list(METRICS.values()) + [STALL_METRIC.format(reason) for reason in STALLS]
    command = [find_ncu(args.ncu), "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
               "--print-units", "base", "--metrics", ",".join(metrics), sys.executable, __file__, "--shape",
               args.shape, "--case", args.case, "--child", str(labels_path)]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0 or '"ID"' not in run.stdout:
        raise SystemExit(f"ncu_lora: ncu failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    rows = parse(run.stdout, json.loads(labels_path.read_text()))
    print(f"LoRA kernels under ncu, {args.shape}, {CASE_KEYS[args.case]}, one layer:\n{table(rows)}", flush=True)
    args.out.write_text(json.dumps({"shape": args.shape, "case": CASE_KEYS[args.case], "launches": rows}, indent=1))


if __name__ == "__main__":
    main()

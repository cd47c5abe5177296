"""Adapter churn on a GPU (W5 of shared/BENCHMARKS.md; issue 66, part 6), at a model shape with random weights: the
time to bring one adapter (rank 16 and 64, every module of every layer) from pinned host memory into a device slot;
W5's 128 rank-8 adapters through device tiers of 8 and 32 slots, tokens/s against W1 on W1's engine, and the tier's
loads; and, with the larger tier, a decode step's time alone and with an adapter uploaded beside each step (~1x:
the uploads overlap decoding). Prints a table, writes JSON.

    python bench/gpu_churn.py [--shape llama-3.1-8b-shape] [--tiers 8,32] [--requests N] [--out gpu_churn.json]
`--device cpu --shape tiny-shape --requests 16` runs the same code on CPU in seconds (the test suite does).
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.model.checkpoint import ModelConfig                                          # noqa: E402
from bench.churn import upload_ms, w1, w5                                           # noqa: E402
from bench.step_profile import free_memory                                          # noqa: E402
from scripts.gpu_bench import build_model                                           # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b-shape")
    parser.add_argument("--tiers", default="8,32", help="device tiers (max_loras) W5 runs through")
    parser.add_argument("--requests", type=int, default=0, help="scale W1 and W5 down to N requests (0: as specified)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    parser.add_argument("--out", type=Path, default=Path("gpu_churn.json"))
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("gpu_churn: no CUDA device (use --device cpu for a dry run)")
    graphs = args.cuda_graphs == "on"
    model_dir = str(build_model(args.shape, Path(tempfile.mkdtemp(prefix=f"{args.shape}-")), args.device))
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    report = {"device": name, "shape": args.shape,
              "upload": upload_ms(ModelConfig.from_dir(model_dir), args.device)}
    free_memory(args.device)
    print("  upload: " + ", ".join(f"rank {rank} {u['ms']:.1f} ms ({u['bytes'] / 1e6:.0f} MB, {u['gb_s']:.1f} GB/s)"
                                   for rank, u in report["upload"].items()), flush=True)
    report["W1"] = w1(model_dir, args.device, args.requests or None, graphs)
    print(f"  W1: {report['W1']['tok_s']:.1f} tok/s", flush=True)
    args.out.write_text(json.dumps(report, indent=1))                 # after each part: a cut-off run keeps its own
    for tier in (int(t) for t in args.tiers.split(",")):
        run = w5(model_dir, args.device, tier, args.requests or None, graphs)
        run["vs_W1"] = run["tok_s"] / report["W1"]["tok_s"]
        report[f"W5_tier_{tier}"] = run
        beside = run.get("uploads_beside_decoding")
        print(f"  W5 through {tier} slots: {run['tok_s']:.1f} tok/s, {run['vs_W1']:.2f} of W1 (issue 66: >= 0.8 at "
              f"32), {run['device_loads']} loads" + (f"; a decode step {beside['step_ms_alone']:.2f} ms alone, "
                                                     f"{beside['step_ms_with_uploads']:.2f} ms with an upload beside "
                                                     f"({beside['ratio']:.2f}x)" if beside else ""), flush=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

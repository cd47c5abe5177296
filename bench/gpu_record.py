"""The GPU figures of record: each figure's latest run, per GPU, read from the dated run files in docs/bench/ (one a
GPU run, as scripts/gpu_bench.py and scripts/gpu_check.sh --server wrote them), written to docs/bench/gpu.json with
the GPU, date, commit and file of the run it comes from. A new run's file goes into RUNS (in date order); then

    python -m bench.gpu_record [--check]          # --check: exit 1 where docs/bench/gpu.json is not up to date
"""
import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "docs" / "bench"
OUT = BENCH_DIR / "gpu.json"


@dataclass(frozen=True)
class Run:
    file: str
    gpu: str
    date: str
    commit: str
    models: str                               # where the file keeps its models, "/"-separated
    weights: str = "bf16"                     # the base weights the run served


RUNS = [                                      # in date order: a later run's figure replaces an earlier one's
    Run("gpu_h200_2026-11-26.json", "NVIDIA H200", "2026-11-26", "7457908", "models"),
    Run("gpu_h100.json", "NVIDIA H100 80GB", "2026-11-26", "the heap freeze (after 46e20be)",
        "after_heap_freeze/models"),
    Run("gpu_h200_2026-11-27.json", "NVIDIA H200", "2026-11-27", "7b2d459", "run/models"),
    Run("gpu_h200_2026-11-27b.json", "NVIDIA H200", "2026-11-27", "9f84e8e", "run/models"),
    Run("gpu_h200_2026-11-27c.json", "NVIDIA H200", "2026-11-27", "a8e76b4", "run/models"),
    Run("gpu_h200_2026-11-29_int8.json", "NVIDIA H200", "2026-11-29", "2d9355d", "models", weights="int8"),
    Run("gpu_h200_2026-11-29_server.json", "NVIDIA H200", "2026-11-29", "2d9355d", "server_bench/models"),
]

FIGURES = {                                   # name -> (unit, path in a model's entry, scale)
    "W1": ("tokens/s", "W1/tok_s", 1),
    "W2": ("tokens/s", "W2/tok_s", 1),
    "W3": ("ms a token", "W3/itl_p50_s", 1000),
    "W3 of the HBM bound": ("fraction", "W3/bandwidth_frac", 1),
    "time to ready (engine)": ("s", "time_to_ready_s", 1),
    "decode attention of its bound": ("fraction", "decode_attention/vs_bound", 1),
    "LoRA kernels a layer, 16 tokens over 16 adapters": (
        "us", "lora_kernels/decode, 16 tokens over 16 adapters/layer/gpu_us", 1),
    "graphed decode step, 16 sequences": ("ms", "decode_profile_base/step_ms_graph", 1),
    "graphed decode step, 16 sequences over 16 adapters": ("ms", "decode_profile_lora/step_ms_graph", 1),
    "server ready (tritonserver)": ("s", "server_ready_s", 1),
    "server stopped idle": ("s", "server_stop_s", 1),
} | {f"W4/W1 at {n} streams": ("ratio", f"W4/{n}/tok_s / W1/{n}/tok_s", 1) for n in (16, 64, 128)}


def lookup(entry: dict, path: str) -> float | None:
    """A number at `path` ("a/b/c", or "p / q": a ratio of two) in a model's entry; None where it has none."""
    if " / " in path:
        top, bottom = (lookup(entry, part) for part in path.split(" / "))
        return None if top is None or bottom is None else top / bottom
    for key in path.split("/"):
        if not isinstance(entry, dict) or key not in entry:
            return None
        entry = entry[key]
    return entry if isinstance(entry, (int, float)) else None


def record(runs: list[Run] = RUNS, bench_dir: Path = BENCH_DIR) -> dict:
    """{gpu: {model (with its weights where not bf16): {figure: {value, unit, date, commit, file}}}}."""
    out: dict = {}
    for run in runs:
        models = json.loads((bench_dir / run.file).read_text())
        for key in run.models.split("/"):
            models = models[key]
        for model, entry in models.items():
            name = model if run.weights == "bf16" else f"{model}, {run.weights} weights"
            for figure, (unit, path, scale) in FIGURES.items():
                value = lookup(entry, path)
                if value is not None:
                    out.setdefault(run.gpu, {}).setdefault(name, {})[figure] = {
                        "value": round(value * scale, 4), "unit": unit, "date": run.date, "commit": run.commit,
                        "file": run.file}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where docs/bench/gpu.json is not up to date")
    args = parser.parse_args()
    text = json.dumps({"provenance": "python -m bench.gpu_record: each figure's latest run per GPU, from the dated "
                                     "run files beside this one", "figures": record()}, indent=1) + "\n"
    if args.check:
        sys.exit(0 if OUT.exists() and OUT.read_text() == text else 1)
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

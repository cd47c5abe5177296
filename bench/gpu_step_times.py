"""W3 (one stream, 128 tokens after a 128-token prompt) step by step on an engine set up as W3 asks (max_num_seqs 1),
or as the GPU bench's (W1's settings, after W1 and W2 ran): each step's wall time, steps one ahead and in turn,
with the start-up heap frozen as the engine loop does and without; --profile adds the host calls of the slowest
steps (torch.profiler). How issue 51's GC stalls were found (the bench's W3 p99 5.5 ms against a 1.1 ms median).

    python bench/gpu_step_times.py [--shape smollm2-135m-shape] [--engine w3|w1] [--profile] [--device cuda]
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.heap import freeze_heap, unfreeze_heap                                 # noqa: E402
from backend.model.checkpoint import ModelConfig                                          # noqa: E402
from bench.engine import make_engine, run_engine                                    # noqa: E402
from bench.workloads import WORKLOADS, make_requests                                # noqa: E402
from scripts.gpu_bench import build_model                                           # noqa: E402


def w3_steps(engine, prompt: list[int], label: str) -> list[float]:
    """One W3 request; prints tok/s, the median and mean step, and the steps over 1.5x the median."""
    engine.add_request(prompt, max_new_tokens=128, ignore_end_id=True)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start, times = time.perf_counter(), []
    while engine.has_unfinished:
        before = time.perf_counter()
        with record_function(f"step {len(times)}"):
            engine.step()
        times.append(time.perf_counter() - before)
    ms = [t * 1e3 for t in times]
    median = statistics.median(ms[2:])
    print(f"{label}: {128 / (time.perf_counter() - start):.1f} tok/s, step median {median:.3f} ms, mean "
          f"{statistics.mean(ms[2:]):.3f}; over 1.5x the median: "
          f"{[(i, round(m, 2)) for i, m in enumerate(ms) if m > 1.5 * median][:24]}", flush=True)
    return ms


def slowest_steps(prof, ms: list[float], num: int = 3) -> None:
    """The longest host calls inside each of the slowest steps."""
    events = prof.events()
    marks = {e.name: e for e in events if e.name.startswith("step ")}
    for i in sorted(range(2, len(ms)), key=lambda i: -ms[i])[:num]:
        mark = marks[f"step {i}"]
        lo, hi = mark.time_range.start, mark.time_range.end
        inside = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU
                         and lo <= e.time_range.start <= hi and e is not mark),
                        key=lambda e: e.time_range.start - e.time_range.end)
        print(f"  step {i}, {ms[i]:.2f} ms: " + ", ".join(
            f"{e.name} {(e.time_range.end - e.time_range.start) / 1e3:.3f}" for e in inside[:10]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m-shape")
    parser.add_argument("--engine", choices=("w3", "w1"), default="w3")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    model_dir = str(build_model(args.shape, Path(tempfile.mkdtemp()), args.device))
    cfg = ModelConfig.from_dir(model_dir)
    engine = make_engine(model_dir, "bfloat16", WORKLOADS[args.engine.upper()], args.device)
    print(f"steps {'one ahead' if engine.overlap else 'in turn'}; fallbacks: {engine.runner.kernel_fallbacks or 'none'}")
    if args.engine == "w1":
        for name in ("W1", "W2"):
            run_engine(engine, make_requests(WORKLOADS[name], cfg.vocab_size, 16), name)
    prompt = make_requests(WORKLOADS["W3"], cfg.vocab_size)[0]["prompt"]
    w3_steps(engine, prompt, "warm-up")
    overlap = engine.overlap
    for frozen in (False, True):
        if frozen:
            freeze_heap()
        for ahead in ((True, False) if overlap else (False,)):
            engine.overlap = ahead
            w3_steps(engine, prompt, f"{'one ahead' if ahead else 'in turn'}, heap {'' if frozen else 'not '}frozen")
        engine.overlap = overlap
    if args.profile:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ms = w3_steps(engine, prompt, "profiled")
        slowest_steps(prof, ms)
    unfreeze_heap()


if __name__ == "__main__":
    main()

"""The benchmarks of shared/BENCHMARKS.md as a library: workloads, the engine, gRPC and OpenAI server runs, the HF
and vLLM baselines, the roofline probes, the report and plots. Entry points: scripts/bench.py, bench/bench_kernels.py,
scripts/gpu_bench.py."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (str(ROOT), str(ROOT / "scripts")):              # the servers come from scripts/launch_server.py
    if _path not in sys.path:
        sys.path.append(_path)

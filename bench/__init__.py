"""Benchmarks, probes and experiments. The library of shared/BENCHMARKS.md's benchmarks: workloads, the engine, gRPC
and OpenAI server runs, the HF and vLLM baselines, the roofline probes, the report and plots (entry points:
scripts/bench.py, scripts/gpu_bench.py); and the runs beside it (python bench/NAME.py or python -m bench.NAME)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (str(ROOT), str(ROOT / "scripts")):              # the servers come from scripts/launch_server.py
    if _path not in sys.path:
        sys.path.append(_path)

"""The compiled CPU kernels alone, at one decode step's shapes for the model (every layer's own operands, so they come
from memory as in a step): the GEMMs of every layer and the lm_head at a few row counts, decode attention over
paged caches, LoRA of 16 adapters over every band. Prints each one's median time and the rate it reads its operands
at, to judge a kernel change in isolation (docs/performance.md quotes it); the engine-level figures come from
scripts/bench.py.

    .venv/bin/python bench/bench_kernels.py                       # SmolLM2-135M, ~15 s
    .venv/bin/python bench/bench_kernels.py --kernels linear --rows 1,32,128
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_kernels import main  # noqa: E402

if __name__ == "__main__":
    main(__doc__)

"""The project's benchmarks (workloads of shared/BENCHMARKS.md) and their baselines, measured in one run.

    python scripts/bench.py --workload all --out results.json --plot plots/     # the whole suite (~30 min)
    python scripts/bench.py --workload all --quick                             # every workload scaled down (<10 min)
    python scripts/bench.py --workload W2,W3 --requests 16 --baseline none     # a quick look at two of them
    python scripts/bench.py --workload W1,W2,W3 --requests 32 --baseline vllm  # against vLLM's CPU build
    python scripts/bench.py --workload W4,W9,W8,W10 --requests 32 --baseline none   # gRPC against the OpenAI API
    python scripts/bench.py --workload W1 --requests 32 --baseline none --log-probs 5   # every request: 5 top
    python scripts/bench.py --workload W2 --requests 32 --baseline none --beams 4 [--sampled]   # 4 beams (samples)
    python scripts/bench.py --host-profile                                     # host ms per decode step, by stage
    python scripts/bench.py --host-profile --host-churn --host-forward cached  # ... while sequences end
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.run import main  # noqa: E402

if __name__ == "__main__":
    main(__doc__)

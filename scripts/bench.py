"""The project's benchmarks (workloads of shared/BENCHMARKS.md) and their baselines, measured in one run.

    python scripts/bench.py --workload W2,W3 --baseline hf --out results.json
    python scripts/bench.py --workload all --requests 16      # scaled down for a quick look
"""
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_workloads import WORKLOADS, make_requests          # noqa: E402
from bench_baselines import run_hf                             # noqa: E402
from bench_server import run_server_workload                   # noqa: E402
from backend import LLMEngine                                  # noqa: E402
from backend.model.config import ModelConfig                   # noqa: E402


def measure_roofline() -> tuple[float, float]:
    """bf16 2048^3 matmul throughput (GFLOP/s) and memory copy bandwidth (GB/s), on this machine now."""
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, dtype=torch.bfloat16)
    a @ b
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    gflops = 5 * 2 * 2048 ** 3 / (time.perf_counter() - t) / 1e9
    src = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    gbps = 5 * 2 * src.numel() / (time.perf_counter() - t) / 1e9
    return gflops, gbps


def flops_per_token(cfg: ModelConfig, context: int) -> float:
    """2 x parameters touched per token (projections, MLP, lm_head) plus attention over `context` tokens."""
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    params = cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size
    return 2 * params + 4 * cfg.num_layers * context * cfg.q_size


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def run_engine(engine: LLMEngine, requests: list[dict]) -> dict:
    """All requests at t=0; tokens/s over the whole run, TTFT and inter-token latencies per request."""
    start = time.perf_counter()
    first: dict = {}
    last: dict = {}
    gaps: list[float] = []
    num_tokens = 0
    for r in requests:
        engine.add_request(r["prompt"], lora_task_id=r.get("lora_task_id"), max_new_tokens=r["max_new_tokens"],
                           ignore_end_id=True)
    num_steps, step_time = 0, 0.0
    while engine.has_unfinished:
        t = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        num_steps += 1
        step_time += now - t
        for out in outputs:
            if out.error:
                raise RuntimeError(out.error)
            if out.new_token_ids:
                num_tokens += len(out.new_token_ids)
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                first.setdefault(out.request_id, now - start)
                last[out.request_id] = now
    elapsed = time.perf_counter() - start
    ttfts = list(first.values())
    return {"tok_s": num_tokens / elapsed, "seconds": elapsed, "output_tokens": num_tokens, "steps": num_steps,
            "step_seconds": step_time,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W2,W3", help="W1..W5, a comma list, or all")
    parser.add_argument("--requests", type=int, help="scale the workload down to N requests")
    parser.add_argument("--baseline", choices=("hf", "none"), default="hf")
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; available: {', '.join(WORKLOADS)}")

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = ModelConfig.from_dir(args.model_dir)
    gflops, gbps = measure_roofline()
    weight_bytes = flops_per_token(cfg, 0) / 2 * torch.finfo(getattr(torch, args.dtype)).bits / 8
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}, "
                                f"torch {torch.__version__}, {args.dtype}",
                     "roofline_gflops": gflops, "memory_gbps": gbps}
    print(f"roofline: bf16 matmul {gflops:.0f} GFLOP/s, memory copy {gbps:.1f} GB/s; model {weight_bytes / 1e6:.0f} MB")
    for name in names:
        workload = WORKLOADS[name]
        requests = make_requests(workload, cfg.vocab_size, args.requests)
        if workload.server:
            res = run_server_workload(args.model_dir, requests, workload, args.dtype)
        else:
            engine = LLMEngine(args.model_dir, dtype=args.dtype, kernel_backend="torch",
                               max_num_seqs=workload.max_num_seqs, max_num_batched_tokens=2048,
                               max_loras=workload.max_loras, max_lora_rank=workload.max_lora_rank)
            workload.setup(engine)
            res = run_engine(engine, requests)
            del engine
        prompt_tokens = sum(len(r["prompt"]) for r in requests)
        mean_ctx = sum(len(r["prompt"]) + r["max_new_tokens"] / 2 for r in requests) / len(requests)
        work = (prompt_tokens + res["output_tokens"]) * flops_per_token(cfg, int(mean_ctx))
        res["roofline_frac"] = work / res["seconds"] / 1e9 / gflops
        if name == "W3":
            res["bandwidth_bound_tok_s"] = gbps * 1e9 / weight_bytes
            res["bandwidth_frac"] = res["tok_s"] / res["bandwidth_bound_tok_s"]
        results[name] = res
        line = f"{name}: {res['tok_s']:.1f} tok/s ({res['output_tokens']} tokens in {res['seconds']:.1f} s), " \
               f"{100 * res['roofline_frac']:.1f}% of roofline"
        if args.baseline == "hf" and workload.hf_baseline:
            base = run_hf(args.model_dir, requests, args.dtype, workload)
            results[f"{name}_hf"] = base
            line += f"; HF {base['tok_s']:.1f} tok/s -> {res['tok_s'] / base['tok_s']:.2f}x"
        print(line, flush=True)
    for a, b in (("W1", "W2"), ("W4", "W1")):
        if a in results and b in results:
            results[f"{a}_over_{b}"] = results[a]["tok_s"] / results[b]["tok_s"]
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

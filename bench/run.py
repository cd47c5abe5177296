"""scripts/bench.py: the workloads asked for and their baselines, measured in one run (rounds with --repeat)."""
import argparse
import json
import os
import platform
from pathlib import Path

import torch

from backend.device import projection_dtype, resolve_dtype
from backend.heap import freeze_heap, unfreeze_heap
from backend.model.checkpoint import ModelConfig
from bench import ROOT
from bench.engine import make_engine, run_engine, sweep_concurrency
from bench.hf import run_hf
from bench.report import combine_rounds, median_ratios, print_drift, print_table
from bench.roofline import cpu_name, measure_roofline, workload_flops, weight_bytes
from bench.vllm_baseline import run_vllm
from bench.workloads import WORKLOADS, make_requests
from kernels.dispatch import resolve_backend

QUICK_REQUESTS = 32                           # --quick caps every workload at this many requests


def num_requests(name: str, args) -> int:
    """The workload's requests, scaled down by --requests or --quick."""
    total = WORKLOADS[name].num_requests
    return min(total, args.requests or (QUICK_REQUESTS if args.quick else total))


def run_workload(name: str, args, cfg: ModelConfig, roofline: dict, samples: dict, kv_reuse: bool | None = None,
                 sweep: bool = False) -> dict:
    workload = WORKLOADS[name]
    requests = make_requests(workload, cfg.vocab_size, num_requests(name, args))
    if args.log_probs is not None:                       # every request asks for log probs and k alternatives
        for r in requests:
            r["sampling"] = {"return_log_probs": True, "top_log_probs": args.log_probs}
    if args.beams is not None:                           # every request: k beams, or (--sampled) k samples
        for i, r in enumerate(requests):
            r["sampling"] = ({"num_return_sequences": args.beams, "temperature": 1.0, "seed": i} if args.sampled
                             else {"beam_width": args.beams, "num_return_sequences": args.beams})
    if workload.server:                                  # (tritonclient: not on a GPU machine's image)
        from bench.openai_api import run_openai_workload
        from bench.server import run_server_workload
        run = run_openai_workload if workload.api == "openai" else run_server_workload
        res = run(args.model_dir, requests, workload, args.dtype, workload.concurrency,
                  kernel_backend=args.kernel_backend)
    else:
        engine = make_engine(args.model_dir, args.dtype, workload, kv_reuse=kv_reuse,
                             kernel_backend=args.kernel_backend, tensor_parallel_size=args.tensor_parallel_size,
                             weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype,
                             lm_head_dtype=args.lm_head_dtype)
        freeze_heap()                                    # as a server's engine loop does
        res = run_engine(engine, requests, name)
        if sweep and name in ("W1", "W2"):
            res["sweep"] = sweep_concurrency(engine, requests, name)
        engine.close()
        del engine
        unfreeze_heap()
    samples[name if kv_reuse is not False else f"{name}_no_reuse"] = {"TTFT": res.pop("ttfts_s"),
                                                                      "ITL": res.pop("itls_s")}
    res["requests"] = len(requests)
    res["roofline_frac"] = workload_flops(cfg, requests) / res["seconds"] / 1e9 / roofline["roofline_gflops"]
    if name == "W3":
        res["bandwidth_bound_tok_s"] = (roofline["memory_gbps"] * 1e9
                                        / weight_bytes(cfg, args.served_dtype, args.weight_dtype, args.lm_head_dtype))
        res["bandwidth_frac"] = res["tok_s"] / res["bandwidth_bound_tok_s"]
    label = name if kv_reuse is not False else f"{name} without KV reuse"
    print(f"{label}: {res['tok_s']:.1f} tok/s ({res['output_tokens']} tokens in {res['seconds']:.1f} s), "
          f"TTFT p50 {res['ttft_p50_s']:.2f} s, {100 * res['roofline_frac']:.1f}% of roofline", flush=True)
    return res


def run_ours(names: list[str], args, cfg: ModelConfig, roofline: dict, samples: dict, sweep: bool) -> dict:
    results = {}
    for name in names:
        results[name] = run_workload(name, args, cfg, roofline, samples, sweep=sweep)
        if WORKLOADS[name].kv_reuse:
            results[f"{name}_no_reuse"] = run_workload(name, args, cfg, roofline, samples, kv_reuse=False)
    return results


def run_baselines(names: list[str], args, cfg: ModelConfig) -> dict:
    """The baselines asked for, on the same seeded requests as ours."""
    requests = {name: make_requests(WORKLOADS[name], cfg.vocab_size, num_requests(name, args)) for name in names}
    results = {}
    for name in names:
        if args.baseline in ("hf", "both") and WORKLOADS[name].hf_baseline:
            results[f"{name}_hf"] = run_hf(args.model_dir, requests[name], args.compute_dtype, WORKLOADS[name])
            print(f"{name}_hf: {results[f'{name}_hf']['tok_s']:.1f} tok/s", flush=True)
    if args.baseline in ("vllm", "both"):
        runs = {name: (requests[name], WORKLOADS[name]) for name in names if not WORKLOADS[name].server}
        results |= {f"{name}_vllm": res for name, res in run_vllm(args.model_dir, runs, args.compute_dtype).items()}
    return results


def main(doc: str = __doc__) -> None:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W2,W3", help="W1..W10, a comma list, or all")
    parser.add_argument("--requests", type=int, help="scale every workload down to at most N requests")
    parser.add_argument("--quick", action="store_true", help=f"at most {QUICK_REQUESTS} requests per workload")
    parser.add_argument("--baseline", choices=("hf", "vllm", "both", "none"), default="hf",
                        help="HF transformers + PEFT, vLLM's CPU build (installed into .venv-vllm on first use), both")
    parser.add_argument("--kernel-backend", default="auto", choices=("auto", "torch", "cpu"),
                        help="auto: the compiled CPU kernels where they build, else torch")
    parser.add_argument("--model-dir", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="the engine workloads over N ranks (processes; on one CPU a functional figure only)")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where this CPU has native bf16, else float32")
    parser.add_argument("--weight-dtype", default="auto", choices=("auto", "int8", "int4", "fp8"),
                        help="the engine's weight_dtype (int8, int4, fp8: weight-only, quantized at load)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"),
                        help="the engine's kv_cache_dtype (int8: scales calibrated at start; fp8: scales 1.0)")
    parser.add_argument("--lm-head-dtype", default="auto", choices=("auto", "int8", "int4", "fp8"),
                        help="the engine's lm_head_dtype (the LM head quantized at load as well)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the workloads and their baselines N times in turn (ours first in odd rounds; in "
                             "even ones the baselines first, then ours in reverse order); report each one's median "
                             "run and each ratio's median over the rounds")
    parser.add_argument("--log-probs", type=int, metavar="K",
                        help="in-process workloads: every request asks for its tokens' log probs and K alternatives")
    parser.add_argument("--beams", type=int, metavar="K",
                        help="every request a beam search of width K (tokens/s: every beam's tokens)")
    parser.add_argument("--sampled", action="store_true", help="with --beams: K sampled sequences instead")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots (adds a concurrency sweep)")
    parser.add_argument("--host-profile", action="store_true",
                        help="instead of the workloads: host ms per decode step by stage (tiny model)")
    parser.add_argument("--host-device", default="cpu",
                        help="the host profile's device (cuda: the real uploads, graph replays and waits)")
    parser.add_argument("--host-forward", choices=("real", "cached"), default="real",
                        help="the host profile's forward: cached copies its logits after the first call (the host's "
                             "own time, its caches as warm as a GPU's host keeps them)")
    parser.add_argument("--host-evict-mb", type=int, default=0,
                        help="with --host-forward cached: each forward reads this many MB of a buffer of its own (the "
                             "eviction a CPU forward's KV reads cause, alone)")
    parser.add_argument("--host-detail", action="store_true",
                        help="the host profile's outputs stage split by function (launch, graph step, collect, ...)")
    parser.add_argument("--host-churn", action="store_true",
                        help="the host profile's steps while one sequence ends every other step (rows that change)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.host_profile:
        return run_host_profile(args)
    compute_dtype = resolve_dtype(args.dtype, torch.device("cpu"))      # the engines take args.dtype as it is
    served_dtype = projection_dtype(args.dtype, compute_dtype, resolve_backend(args.kernel_backend, "cpu"))
    args.compute_dtype, args.served_dtype = (str(d).removeprefix("torch.") for d in (compute_dtype, served_dtype))
    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; available: {', '.join(WORKLOADS)}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")

    cfg = ModelConfig.from_dir(args.model_dir)
    roofline = measure_roofline(args.compute_dtype)
    precision = args.compute_dtype if args.served_dtype == args.compute_dtype else \
        f"{args.compute_dtype} over {args.served_dtype} weights"
    results: dict = {"machine": f"{machine()}, {precision}, kernels {args.kernel_backend}, "
                                f"tensor_parallel_size {args.tensor_parallel_size}",
                     **roofline,
                     "model": Path(args.model_dir).name, "quick": args.quick}
    print(f"{results['machine']}: {args.compute_dtype} matmul {roofline['roofline_gflops']:.0f} GFLOP/s, memory copy "
          f"{roofline['memory_gbps']:.1f} GB/s; model weights "
          f"{weight_bytes(cfg, args.served_dtype, args.weight_dtype, args.lm_head_dtype) / 1e6:.0f} MB", flush=True)
    samples: dict = {}
    rounds = []
    for i in range(args.repeat):
        if args.repeat > 1:
            print(f"round {i + 1} of {args.repeat}", flush=True)
        kept = samples if i == 0 else {}                      # latency samples (plots) from the first round
        order = names[::-1] if i % 2 else names               # drift falls on every side of each ratio
        parts = [lambda: run_ours(order, args, cfg, roofline, kept, sweep=bool(args.plot) and i == 0),
                 lambda: run_baselines(names, args, cfg)]
        if i % 2:                                             # the baselines first, ours in reverse order
            parts.reverse()
        rounds.append(parts[0]() | parts[1]())
    chosen, ratio_rounds = combine_rounds(rounds)
    results |= chosen
    results["ratios"] = median_ratios(results, ratio_rounds)
    if args.repeat > 1:
        results["ratio_rounds"] = ratio_rounds
    results["roofline_after"] = measure_roofline(args.compute_dtype)
    print_table(results, [n for name in names for n in (name, f"{name}_no_reuse") if n in results])
    print_drift(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if args.plot:
        write_plots(args.plot, results, samples)


def machine() -> str:
    return f"{platform.machine()} {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}"


def run_host_profile(args) -> None:
    from bench.host_profile import host_profile, print_profile
    result = {"machine": machine(), **host_profile(kernel_backend=args.kernel_backend, device=args.host_device,
                                                  detail=args.host_detail, forward=args.host_forward,
                                                  evict_mb=args.host_evict_mb, churn=args.host_churn)}
    print_profile(result, result["machine"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


def write_plots(out_dir: Path, results: dict, samples: dict) -> None:
    from bench.plots import plot_latency_cdf, plot_sweeps
    out_dir.mkdir(parents=True, exist_ok=True)
    sweeps = {n: results[n]["sweep"] for n in ("W1", "W2") if "sweep" in results.get(n, {})}
    if sweeps:
        baselines = {f"{n} HF": results[f"{n}_hf"]["tok_s"] for n in sweeps if f"{n}_hf" in results}
        plot_sweeps(sweeps, baselines, results["machine"], out_dir / "throughput_vs_concurrency.png")
    for n in ("W4", "W1"):
        if n in samples:
            plot_latency_cdf(samples[n], f"{n} latency CDF, {results[n]['requests']} requests\n{results['machine']}",
                             out_dir / f"{n.lower()}_latency_cdf.png")
    print(f"plots in {out_dir}")

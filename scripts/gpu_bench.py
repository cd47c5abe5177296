"""The GPU bench: W1, W2, W3 of shared/BENCHMARKS.md on random-weight models of real shapes, against transformers
(+ PEFT) on the same GPU in the same run, and W3 against the HBM bandwidth bound (and with each step waiting for
its tokens, overlap_steps off: what running a step ahead gains; and on an engine of its own, max_num_seqs 1, as W3
asks, where the main run's W3 shares W1's engine); the decode step profiled with and
without adapters, the LoRA kernels alone per projection (bench/lora_kernels.py: GPU time from a graph replay,
host dispatch time, the adapter-bytes bound, the base GEMM, the LoRA left on the critical path beside the GEMM),
and the adapter-count curve (bench/adapter_curve.py: 64 decoding sequences over 1-64 distinct adapters against
none). Prints one table, writes JSON.

    python scripts/gpu_bench.py [--models smollm2-135m-shape,llama-3.1-8b-shape] [--requests N] [--baseline hf|none]
    (also qwen3-8b-shape, gemma-3-4b-shape; the mixtures qwen3-30b-a3b-shape and mixtral-8x7b-shape, with
    --baseline none [--num-layers N])
        [--hf-requests 16] [--out docs/bench/gpu_<gpu>_<date>.json] [--device cuda]
With its defaults it runs both shapes within 10 minutes on one H100 or H200: the engine runs each workload whole,
HF + PEFT 16 requests of each (two batches; W1's HF run took ~23 s a batch at the 8B shape, 128 requests ~6 min).
`--device cpu --models tiny-shape` runs the same code on CPU in seconds (the test suite does, to keep it working).
"""
import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backend.heap import freeze_heap, unfreeze_heap                                 # noqa: E402
from backend.model.checkpoint import ModelConfig                                          # noqa: E402
from bench.adapter_curve import adapter_curve                                       # noqa: E402
from bench.adapter_curve import summary as curve_summary                            # noqa: E402
from bench.engine import make_engine, run_engine                                    # noqa: E402
from bench.hf import run_hf                                                         # noqa: E402
from bench.lora_kernels import lora_kernels, summary                                # noqa: E402
from bench.roofline import weight_bytes                                             # noqa: E402
from bench.step_profile import (decode_attention_vs_bound, decode_step_profile, free_memory,  # noqa: E402
                                single_sequence_attention, sync)
from bench.workloads import WORKLOADS, make_requests                                # noqa: E402

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
         "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02}
SHAPES = {
    "smollm2-135m-shape": LLAMA | dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                       tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192),
    "llama-3.1-8b-shape": LLAMA | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                       tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192}),
    "qwen3-8b-shape": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                       "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 4096,
                       "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
                       "rope_theta": 1_000_000.0, "max_position_embeddings": 40960},
    "gemma-3-4b-shape": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                         "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "bos_token_id": 2,
                         "eos_token_id": 1, "pad_token_id": 0, "hidden_size": 2560, "intermediate_size": 10240,
                         "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                         "vocab_size": 262208, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                         "sliding_window": 1024, "max_position_embeddings": 131072,
                         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                "rope_theta": 1_000_000.0},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
    # the mixtures (random weights: 61 and 93 GB in bf16; where the disk holds less, --num-layers cuts them)
    "qwen3-30b-a3b-shape": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
                            "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 2048,
                            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                            "num_experts_per_tok": 8, "norm_topk_prob": True, "num_hidden_layers": 48,
                            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                            "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1_000_000.0,
                            "max_position_embeddings": 40960},
    "mixtral-8x7b-shape": LLAMA | dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
                                       intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       vocab_size=32000, tie_word_embeddings=False, rope_theta=1_000_000.0,
                                       max_position_embeddings=32768),
    "tiny-shape": LLAMA | dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
                               rope_theta=10000.0, max_position_embeddings=1024),
}


def build_model(shape: str, out: Path, device: str, **overrides) -> Path:
    """A random-weight bf16 checkpoint of the shape (config fields overridden by `overrides`), made on the device
    (seconds even for 8B), saved as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = dict(SHAPES[shape]) | overrides
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out)
    del model
    free_memory(device)
    return out


def cached_model(shape: str, root: Path, device: str, name: str = "", **overrides) -> Path:
    """build_model into root/<name or shape>, unless a complete one is there (checks of one run share it)."""
    out = root / (name or shape)
    if not ((out / "config.json").is_file() and any(out.glob("*.safetensors"))):
        shutil.rmtree(out, ignore_errors=True)
        build_model(shape, out, device, **overrides)
    return out


def copy_bandwidth(device: str) -> float:
    """Device memory bandwidth (bytes/s, read + write) of a 1 GiB copy."""
    src = torch.empty(1 << 30 if device != "cpu" else 1 << 26, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 10 * 2 * src.numel() / (time.perf_counter() - start)


def figures(run: dict) -> dict:
    """A run's figures, not its samples."""
    return {k: v for k, v in run.items() if not isinstance(v, list)}


def w3_on_its_own_engine(model_dir: str, cfg: ModelConfig, shape: str, args) -> dict:
    """W3 on an engine set up as W3 asks (max_num_seqs 1, no adapters): BENCHMARKS.md's single stream, where the
    main run's W3 shares W1's engine (128 rows of graphs, 16 adapters resident)."""
    engine = make_engine(model_dir, "bfloat16", WORKLOADS["W3"], args.device, cuda_graph_mode=args.cuda_graphs == "on",
                         weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype,
                         lm_head_dtype=args.lm_head_dtype)
    freeze_heap()
    try:
        requests = make_requests(WORKLOADS["W3"], cfg.vocab_size)
        run_engine(engine, requests, f"{shape} W3 warm-up")
        run = figures(run_engine(engine, requests, f"{shape} W3 on its own engine"))
    finally:
        del engine
        unfreeze_heap()
        free_memory(args.device)
    print(f"  {shape} W3 on its own engine: {run['tok_s']:.1f} tok/s", flush=True)
    return run


def bench_model(shape: str, args, bandwidth: float) -> dict:
    layers = {"num_hidden_layers": args.num_layers} if args.num_layers else {}
    model_dir = str(build_model(shape, Path(tempfile.mkdtemp(prefix=f"{shape}-")), args.device, **layers))
    cfg = ModelConfig.from_dir(model_dir)
    results = {}
    started = time.perf_counter()
    engine = make_engine(model_dir, "bfloat16", WORKLOADS["W1"], args.device, cuda_graph_mode=args.cuda_graphs == "on",
                         weight_dtype=args.weight_dtype, kv_cache_dtype=args.kv_cache_dtype,
                         lm_head_dtype=args.lm_head_dtype)
    results["time_to_ready_s"] = time.perf_counter() - started          # weights, self-check, graph capture
    results["kernel_fallbacks"] = dict(engine.runner.kernel_fallbacks)    # overlap_steps among them if it failed
    freeze_heap()                                                       # as a server's engine loop does
    print(f"  {shape} ready in {results['time_to_ready_s']:.1f} s, steps {'one ahead' if engine.overlap else 'in turn'}"
          f"; fallbacks: {results['kernel_fallbacks'] or 'none'}", flush=True)
    for name in ("W1", "W2", "W3"):
        workload = WORKLOADS[name]
        requests = make_requests(workload, cfg.vocab_size, args.requests and min(args.requests, workload.num_requests))
        run_engine(engine, requests[:2], f"{shape} {name} warm-up")        # compile the kernels outside the timing
        run = run_engine(engine, requests, f"{shape} {name}")
        results[name] = figures(run)
        sync(args.device)
        print(f"  {shape} {name}: {results[name]['tok_s']:.1f} tok/s", flush=True)
    requests = make_requests(WORKLOADS["W1"], cfg.vocab_size, args.requests and min(args.requests, 128))
    for r in requests:                          # W1 where every request asks for its log probs and 5 alternatives
        r["sampling"] = {"return_log_probs": True, "top_log_probs": 5}
    results["W1_log_probs"] = figures(run_engine(engine, requests, f"{shape} W1 log probs"))
    results["W1_log_probs"]["vs_W1"] = results["W1_log_probs"]["tok_s"] / results["W1"]["tok_s"]
    print(f"  {shape} W1, logprobs 5: {results['W1_log_probs']['tok_s']:.1f} tok/s "
          f"({results['W1_log_probs']['vs_W1']:.3f} of W1; issue 69: >= 0.9)", flush=True)
    if engine.overlap:                          # W3 again, each step waiting for its tokens: what running ahead gains
        engine.overlap = False
        run = run_engine(engine, make_requests(WORKLOADS["W3"], cfg.vocab_size), f"{shape} W3 steps in turn")
        results["W3_in_turn"] = figures(run)
        engine.overlap = True
        print(f"  {shape} W3, steps in turn: {run['tok_s']:.1f} tok/s", flush=True)
    for label, task_ids in (("decode_profile_single", [None]), ("decode_profile_base", [None] * 16),
                            ("decode_profile_lora", list(range(1, 17)))):
        requests = make_requests(WORKLOADS["W1"], cfg.vocab_size, len(task_ids))
        for r, task in zip(requests, task_ids):
            r["lora_task_id"] = task
        try:
            results[label] = decode_step_profile(engine, requests)
        except Exception as err:                                  # a measurement, not worth the run
            results[label] = {"error": f"{type(err).__name__}: {err}"}
        print(f"  {shape} {label}: {results[label]}", flush=True)
    del engine
    unfreeze_heap()
    free_memory(args.device)
    results["W3_own_engine"] = w3_on_its_own_engine(model_dir, cfg, shape, args)
    if args.curve_seqs:
        try:
            results["adapter_curve"] = adapter_curve(model_dir, args.device, args.curve_seqs,
                                                     tuple(int(n) for n in args.curve_counts.split(",")),
                                                     cuda_graph_mode=args.cuda_graphs == "on")
            print(f"  {shape} {curve_summary(results['adapter_curve'])}", flush=True)
        except Exception as err:                                      # a measurement, not worth the run
            results["adapter_curve"] = {"error": f"{type(err).__name__}: {err}"}
        free_memory(args.device)
    try:
        results["lora_kernels"] = lora_kernels(cfg, args.device, bandwidth)
        print("\n".join(summary(results["lora_kernels"])), flush=True)
    except Exception as err:                                          # a measurement, not worth the run
        results["lora_kernels"] = {"error": f"{type(err).__name__}: {err}"}
    free_memory(args.device)
    if args.device != "cpu":
        try:
            results["decode_attention"] = decode_attention_vs_bound(cfg, bandwidth)
        except Exception as err:                                      # a measurement, not worth the run
            results["decode_attention"] = {"error": f"{type(err).__name__}: {err}"}
        print(f"  {shape} decode attention: {results['decode_attention']}", flush=True)
        try:
            results["single_sequence_attention"] = single_sequence_attention(cfg, device=args.device)
        except Exception as err:                                      # a measurement, not worth the run
            results["single_sequence_attention"] = {"error": f"{type(err).__name__}: {err}"}
        print(f"  {shape} single-sequence attention: {results['single_sequence_attention']}", flush=True)
        free_memory(args.device)
    context = WORKLOADS["W3"].prompt_range[0] + WORKLOADS["W3"].output_tokens / 2
    kv_bytes = 2 * cfg.num_layers * cfg.kv_size * context * (1 if args.kv_cache_dtype in ("int8", "fp8") else 2)
    bound = bandwidth / (weight_bytes(cfg, "bfloat16", args.weight_dtype, args.lm_head_dtype) + kv_bytes)
    for name in ("W3", "W3_own_engine"):
        results[name] |= {"bandwidth_bound_tok_s": bound, "bandwidth_frac": results[name]["tok_s"] / bound}
    if args.baseline == "hf":
        for name in ("W2", "W3", "W1"):
            workload = WORKLOADS[name]
            requests = make_requests(workload, cfg.vocab_size, min(args.hf_requests, workload.num_requests))
            results[f"{name}_hf"] = run_hf(model_dir, requests, "bfloat16", workload, device=args.device)
            print(f"  {shape} {name} HF: {results[f'{name}_hf']['tok_s']:.1f} tok/s", flush=True)
            free_memory(args.device)
    return results


def table(report: dict) -> str:
    lines = [f"GPU bench on {report['device']} (copy bandwidth {report['copy_bandwidth_gbps']:.0f} GB/s); ready in "
             + ", ".join(f"{shape} {r['time_to_ready_s']:.1f} s" for shape, r in report["models"].items()),
             f"{'model':22s} {'W1 tok/s':>10s} {'W2 tok/s':>10s} {'W3 tok/s':>9s} {'W3 ITL ms':>10s} "
             f"{'W3/bound':>9s} {'W3/in turn':>10s} {'W3 own':>8s} {'W1/HF':>7s} {'W2/HF':>7s} {'W1/W2':>7s}"]
    for shape, r in report["models"].items():
        ratio = lambda a, b: f"{r[a]['tok_s'] / r[b]['tok_s']:.2f}" if a in r and b in r else "-"   # noqa: E731
        lines.append(f"{shape:22s} {r['W1']['tok_s']:10.1f} {r['W2']['tok_s']:10.1f} {r['W3']['tok_s']:9.1f} "
                     f"{r['W3']['itl_p50_s'] * 1e3:10.2f} {r['W3']['bandwidth_frac']:9.1%} "
                     f"{ratio('W3', 'W3_in_turn'):>10s} {r['W3_own_engine']['tok_s']:8.1f} "
                     f"{ratio('W1', 'W1_hf'):>7s} {ratio('W2', 'W2_hf'):>7s} {ratio('W1', 'W2'):>7s}")
    lines.append("W3 runs on W1's engine (max_num_seqs 128, 16 adapters resident); W3 own: on one set up as W3 asks "
                 "(max_num_seqs 1)")
    lines.append("targets: W3 8B >= 80% of the bound (issue 51: >= 75%; SmolLM2 shape >= 1000 tok/s), W1/W2 >= 0.85 "
                 "(goal 0.9), W1 >= 10x HF + PEFT; LoRA a layer for 16 tokens over 16 adapters <= 40 us (<= 2.5x its "
                 "bound, <= 30% of the base GEMMs); a graphed decode step with 16 adapters <= 1.3x the same without")
    for shape, r in report["models"].items():
        for label in ("decode_profile_single", "decode_profile_base", "decode_profile_lora"):
            p = r.get(label, {})
            if "launches_per_step" in p:
                shares = ", ".join(f"{kind} {share:.0%}" for kind, share in p["gpu_time_share"].items())
                lines.append(f"{shape} {label[15:]} decode step of {p['num_seqs']}: {p['launches_per_layer']:.1f} "
                             f"launches/layer, eager {p['step_ms_eager']:.2f} ms, graph "
                             f"{p.get('step_ms_graph', float('nan')):.2f} ms; kernels {p.get('gpu_busy_ms', 0):.2f} ms "
                             f"({shares}); a graphed step's launches and copies: {p.get('graph_step_host_calls')}")
        if "error" not in r.get("lora_kernels", {"error": ""}):
            lines += [f"{shape}{line}" for line in summary(r["lora_kernels"])]
        if "error" not in r.get("adapter_curve", {"error": ""}):
            lines.append(f"{shape} {curve_summary(r['adapter_curve'])} (target at 64: <= 1.3x)")
        a = r.get("decode_attention", {})
        if "vs_bound" in a:
            lines.append(f"{shape} decode attention, {a['num_seqs']} x {a['context']} tokens: {a['us']:.0f} us, "
                         f"{a['vs_bound']:.2f}x the K/V read time (target <= 1.2x)")
        single = r.get("single_sequence_attention", {})
        if "error" not in single and single:
            lines.append(f"{shape} one sequence's attention a layer, graphed (us at the graphs' splits / at one): "
                         + ", ".join(f"{context} tokens {c['us_graph_splits']:.1f} ({c['graph_splits']}) / "
                                     f"{c['us_one_split']:.1f}" for context, c in single.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m-shape,llama-3.1-8b-shape")
    parser.add_argument("--requests", type=int, default=0, help="scale W1/W2 down to N requests (0: as specified)")
    parser.add_argument("--baseline", choices=("hf", "none"), default="hf",
                        help="none for the mixtures: PEFT moves a dense module's LoRA onto Qwen3-MoE's experts")
    parser.add_argument("--num-layers", type=int, default=0,
                        help="every shape with this many layers (0: its own; the mixtures' checkpoints outgrow a "
                             "64 GB disk)")
    parser.add_argument("--hf-requests", type=int, default=16,
                        help="the HF + PEFT baselines' share of each workload (batches of 8 at ~20 s each at the "
                             "8B shape: its tok/s is a batch's, whatever the count)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--weight-dtype", default="auto", choices=("auto", "int8", "int4", "fp8"),
                        help="the engine's weight_dtype (int8, int4, fp8: weight-only; the HBM bound counts a byte "
                             "or half a byte a weight)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"),
                        help="the engine's kv_cache_dtype (int8, fp8: the HBM bound counts a byte a cached value)")
    parser.add_argument("--lm-head-dtype", default="auto", choices=("auto", "int8", "int4", "fp8"),
                        help="the engine's lm_head_dtype (the HBM bound counts the LM head's bytes so too)")
    parser.add_argument("--cuda-graphs", choices=("on", "off"), default="on",
                        help="off: every step eager (before/after)")
    parser.add_argument("--curve-seqs", type=int, default=64,
                        help="the adapter-count curve's batch of decoding sequences (0: no curve)")
    parser.add_argument("--curve-counts", default="1,4,16,64", help="its numbers of distinct adapters")
    parser.add_argument("--out", type=Path, help="default docs/bench/gpu_<gpu>_<date>.json, a run's file (python -m "
                                                 "bench.gpu_record takes each figure's latest into gpu.json)")
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("gpu_bench: no CUDA device (use --device cpu for a dry run)")
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    if args.out is None:
        gpu = name.lower().replace("nvidia ", "").split()[0]
        args.out = ROOT / "docs" / "bench" / f"gpu_{gpu}_{time.strftime('%Y-%m-%d')}.json"
    bandwidth = copy_bandwidth(args.device)
    report = {"device": name, "torch": torch.__version__, "copy_bandwidth_gbps": bandwidth / 1e9, "models": {}}
    for shape in args.models.split(","):
        report["models"][shape] = bench_model(shape, args, bandwidth)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))           # after each model: a cut-off run keeps its part
    print(table(report), flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

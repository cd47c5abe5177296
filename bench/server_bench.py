"""W4 against W1 on one machine in one run (shared/BENCHMARKS.md): W1's requests through tritonserver over gRPC
streaming at each concurrency, and the same requests in process at the same concurrency (a new request as one
finishes), on random-weight models of real shapes. The server loads W1's 16 adapters at start (its prefetch dir,
as the in-process engine registers them), so both sides do the same work; requests name them by task id. Also the
tokens/s the server path sustains at --wide streams, the server's GPU memory (the device's free memory before it
started and once ready) and the KV cache it chose.

    python bench/server_bench.py [--models smollm2-135m-shape,llama-3.1-8b-shape] [--concurrency 16,64]
        [--wide 128] [--requests N] [--device cuda] [--out server_bench.json]
`--device cpu --models tiny-shape --requests 8 --concurrency 4` runs the same code on CPU in seconds.
The server's responder_steps_behind (model parameter) from the environment: LORA_LLM_RESPONDER_STEPS_BEHIND=4.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "scripts"))

from backend.model.checkpoint import ModelConfig                                          # noqa: E402
from bench.adapters import adapter_dirs                                             # noqa: E402
from bench.engine import make_engine, run_engine                                    # noqa: E402
from bench.server import core_server, prepared_by_id, stream_measured               # noqa: E402
from bench.step_profile import free_memory                                          # noqa: E402
from bench.workloads import WORKLOADS, make_requests                                # noqa: E402
from gpu_bench import cached_model, figures                                         # noqa: E402
from server_probe import free_device_bytes, metric                                  # noqa: E402

W1 = WORKLOADS["W1"]
COMPARED = ("tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")


def kv_cache(metrics_port: int, cfg: ModelConfig, block_size: int = 16) -> dict:
    """The KV cache the server chose, from its lora_llm_kv_blocks gauges (bf16 K and V, every layer)."""
    blocks = sum(metric(metrics_port, "lora_llm_kv_blocks", f'state="{state}"') for state in ("used", "free"))
    tokens = int(blocks) * block_size
    return {"blocks": int(blocks), "tokens": tokens, "bytes": tokens * 2 * cfg.num_layers * cfg.kv_size * 2}


def link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def prefetch_dir(model_dir: str, out: Path) -> Path:
    """<out>/<task id>/: W1's adapters, as the in-process engine registers them."""
    out.mkdir()
    for task_id, path in enumerate(adapter_dirs(model_dir, W1.adapter_ranks), start=1):
        shutil.copytree(path, out / str(task_id), copy_function=link_or_copy)    # the server follows no symlinks
    return out


def in_process(model_dir: str, requests: list[dict], args, concurrencies: list[int]) -> dict:
    engine = make_engine(model_dir, "bfloat16", W1, args.device)
    try:
        run_engine(engine, requests[:2], "warm-up")
        runs = {c: figures(run_engine(engine, requests, f"W1 in process x{c}", concurrency=c)) for c in concurrencies}
    finally:
        del engine
        free_memory(args.device)
    return runs


def bench_shape(shape: str, args, results: dict, save) -> None:
    """Fills `results` (save() after each part: a run cut off keeps what it measured)."""
    work = Path(tempfile.mkdtemp(prefix=f"server_bench-{shape}-"))
    model_dir = str(cached_model(shape, args.models_dir or work, args.device))
    cfg = ModelConfig.from_dir(model_dir)
    requests = make_requests(W1, cfg.vocab_size, args.requests or None)
    concurrencies = [c for c in args.concurrency if c <= len(requests)]
    wide = [args.wide] if args.wide and shape == "smollm2-135m-shape" and args.wide <= len(requests) else []
    results["W1"] = in_process(model_dir, requests, args, concurrencies + wide)
    save()
    print(f"  {shape} W1 in process: " + ", ".join(f"x{c} {r['tok_s']:.0f} tok/s" for c, r in results["W1"].items()),
          flush=True)
    free0 = free_device_bytes(args.device)
    started = time.perf_counter()
    with core_server(model_dir, W1, "bfloat16", prefetch_dir=prefetch_dir(model_dir, work / "prefetch")) as (
            server, grpc, metrics):
        results["server_ready_s"] = time.perf_counter() - started
        free1 = free_device_bytes(args.device)
        results["server_gpu_bytes"] = None if free0 is None else free0 - free1
        results["kv_cache"] = kv_cache(metrics, cfg)
        stream_measured(server, grpc, metrics, prepared_by_id(requests[:2]), requests[:2], W1, 2)    # warm-up
        results["W4"] = {}
        for c in concurrencies + wide:
            run = figures(stream_measured(server, grpc, metrics, prepared_by_id(requests), requests, W1, c))
            want = sum(r["max_new_tokens"] for r in requests)
            if run["output_tokens"] != want:
                raise SystemExit(f"server_bench: {shape} x{c}: the server streamed {run['output_tokens']} tokens of "
                                 f"{want}")
            results["W4"][c] = run
            save()
        stop_started = time.perf_counter()                  # the server idle: its stop (tritonserver's exit)
    results["server_stop_s"] = time.perf_counter() - stop_started
    for c, served in results["W4"].items():
        local = results["W1"][c]
        served["vs_W1"] = served["tok_s"] / local["tok_s"]
        served["ttft_p50_minus_W1_s"] = served["ttft_p50_s"] - local["ttft_p50_s"]
        print(f"  {shape} x{c}: W4 {served['tok_s']:.0f} tok/s, W1 {local['tok_s']:.0f} -> W4/W1 {served['vs_W1']:.3f}; "
              f"TTFT p50/p99 {served['ttft_p50_s'] * 1e3:.1f}/{served['ttft_p99_s'] * 1e3:.1f} ms (in process "
              f"{local['ttft_p50_s'] * 1e3:.1f}/{local['ttft_p99_s'] * 1e3:.1f}); ITL p50/p99 "
              f"{served['itl_p50_s'] * 1e3:.2f}/{served['itl_p99_s'] * 1e3:.2f} ms (in process "
              f"{local['itl_p50_s'] * 1e3:.2f}/{local['itl_p99_s'] * 1e3:.2f}); "
              f"{served['output_tokens'] / served['responses']:.2f} tokens a response", flush=True)
    gpu = results["server_gpu_bytes"]
    print(f"  {shape} server ready in {results['server_ready_s']:.1f} s, stopped idle in "
          f"{results['server_stop_s']:.1f} s; GPU memory it took "
          f"{'-' if gpu is None else f'{gpu / 2**30:.1f} GiB'}; KV cache {results['kv_cache']['tokens']} tokens "
          f"({results['kv_cache']['bytes'] / 2**30:.2f} GiB)", flush=True)
    save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m-shape,llama-3.1-8b-shape")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[16, 64])
    parser.add_argument("--wide", type=int, default=128, help="streams for the SmolLM2 shape's widest run (0: none)")
    parser.add_argument("--requests", type=int, default=0, help="W1's first N requests (0: all 128)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("server_bench.json"))
    parser.add_argument("--models-dir", type=Path, help="where the models are built (and found, if built there)")
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu", "models": {}}
    for shape in args.models.split(","):
        report["models"][shape] = {}
        bench_shape(shape, args, report["models"][shape], lambda: args.out.write_text(json.dumps(report, indent=1)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

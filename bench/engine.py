"""The engine side of the benchmarks: one workload in process, and the throughput sweep over concurrency."""
import resource
import time

from tqdm import tqdm

from backend import LLMEngine


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def own_cpu_seconds() -> float:
    """CPU seconds (user + system) this process has used so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_engine(model_dir: str, dtype: str, workload, device: str = "cpu", kv_reuse: bool | None = None,
                kernel_backend: str = "auto", cuda_graph_mode: bool = True, tensor_parallel_size: int = 1,
                weight_dtype: str = "auto", kv_cache_dtype: str = "auto", lm_head_dtype: str = "auto") -> LLMEngine:
    """The engine as the workload wants it (kernels: auto picks the compiled CPU ones or Triton on CUDA)."""
    engine = LLMEngine(model_dir, dtype=dtype, device=device, kernel_backend=kernel_backend,
                       weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype, lm_head_dtype=lm_head_dtype,
                       cuda_graph_mode=cuda_graph_mode, tensor_parallel_size=tensor_parallel_size,
                       max_num_seqs=workload.max_num_seqs,
                       max_num_batched_tokens=2048, max_loras=workload.max_loras,
                       max_lora_rank=workload.max_lora_rank,
                       enable_kv_cache_reuse=workload.kv_reuse if kv_reuse is None else kv_reuse)
    workload.setup(engine)
    return engine


def run_engine(engine: LLMEngine, requests: list[dict], label: str = "", concurrency: int | None = None) -> dict:
    """All requests at t=0, or `concurrency` at a time (the next added as one finishes, as a client with that many
    streams does); tokens/s over the whole run, TTFT (from each request's arrival) and inter-token latencies."""
    bar = tqdm(total=sum(r["max_new_tokens"] for r in requests), desc=label, unit="tok", leave=False,
               mininterval=2.0)
    cpu0 = own_cpu_seconds()
    start = time.perf_counter()
    arrived: dict = {}
    first: dict = {}
    last: dict = {}
    gaps: list[float] = []
    generated0 = engine.num_generated_tokens
    todo = list(reversed(requests))

    def arrive() -> None:
        r = todo.pop()
        request_id = engine.add_request(r["prompt"], lora=r.get("lora_task_id"), max_new_tokens=r["max_new_tokens"],
                                        ignore_end_id=True, **r.get("sampling", {}))
        arrived[request_id] = time.perf_counter()

    while todo and (concurrency is None or len(arrived) < concurrency):
        arrive()
    num_steps = 0
    step_seconds = {"decode": [], "prefill": []}
    while engine.has_unfinished:
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        num_steps += 1
        step_seconds[engine.last_step_kind].append(now - before)
        for out in outputs:
            if out.error:
                raise RuntimeError(out.error)
            if out.new_token_ids or out.beams:                   # (a beam search: each round its beams)
                bar.update(len(out.new_token_ids) or len(out.beams))
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                first.setdefault(out.request_id, now - arrived[out.request_id])
                last[out.request_id] = now
            if out.finished and todo:
                arrive()
    elapsed = time.perf_counter() - start
    num_tokens = engine.num_generated_tokens - generated0     # every sequence's, each beam's
    cpu = own_cpu_seconds() - cpu0
    bar.close()
    ttfts = list(first.values())
    return {"tok_s": num_tokens / elapsed, "seconds": elapsed, "output_tokens": num_tokens, "steps": num_steps,
            "cpu_seconds": cpu, "concurrency": concurrency or len(requests),
            "kv_reuse_hit_rate": engine.blocks.num_hits / max(1, engine.blocks.num_lookups),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "ttfts_s": ttfts, "itls_s": gaps, **step_figures(step_seconds)}


def step_figures(step_seconds: dict[str, list[float]]) -> dict:
    """Where the engine's time went: decode steps (their mean) and steps with prompt tokens (their sum)."""
    decode = step_seconds["decode"]
    return {"decode_step_mean_s": sum(decode) / len(decode) if decode else float("nan"),
            "num_decode_steps": len(decode), "prefill_step_seconds": sum(step_seconds["prefill"]),
            "num_prefill_steps": len(step_seconds["prefill"])}


def sweep_concurrency(engine: LLMEngine, requests: list[dict], label: str) -> list[dict]:
    """Throughput with 1, 2, 4, ... len(requests) requests at once (the first n of the workload's requests)."""
    points = []
    n = 1
    while n <= len(requests):
        res = run_engine(engine, requests[:n], f"{label} x{n}")
        points.append({"concurrency": n, "tok_s": res["tok_s"]})
        print(f"  {label} with {n:3d} requests at once: {res['tok_s']:7.1f} tok/s", flush=True)
        n *= 2
    return points

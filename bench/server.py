"""W4: the W1 requests through a real tritonserver, gRPC streaming, at a fixed concurrency. The client makes every
request before the clock starts (serialized, as one holding its adapters in TensorRT-LLM form would); the uploads
themselves (gRPC, tritonserver, parsing in the model) are inside the measured window."""
import asyncio
import os
import time
import urllib.request
from functools import partial
from pathlib import Path

from tqdm import tqdm


def run_server_workload(model_dir: str, requests: list[dict], workload, dtype: str, concurrency: int = 32,
                        kernel_backend: str = "auto") -> dict:
    from bench.adapters import adapter_dirs
    from bench.engine import own_cpu_seconds, percentile
    from bench.stream import Prepared, serialize_request, stream_requests
    from launch_server import free_ports, start_server, wait_ready

    from backend.lora.peft import peft_to_trtllm
    from client.grpc_client import input_arrays

    adapters = {task_id: peft_to_trtllm(path, "float16")
                for task_id, path in enumerate(adapter_dirs(model_dir, workload.adapter_ranks), start=1)}
    http, grpc, metrics = free_ports(3)
    env = {"LORA_LLM_MODEL_DIR": model_dir, "LORA_LLM_DTYPE": dtype, "LORA_LLM_KERNEL_BACKEND": kernel_backend,
           "LORA_LLM_MAX_LORAS": str(workload.max_loras), "LORA_LLM_MAX_LORA_RANK": str(workload.max_lora_rank),
           "LORA_LLM_MAX_NUM_SEQS": str(workload.max_num_seqs), "LORA_LLM_MAX_NUM_BATCHED_TOKENS": "2048"}
    server = start_server(http, grpc, metrics, env=env, log_file=open("/tmp/bench_w4_server.log", "w"),
                          models=["lora_llm"])
    try:
        wait_ready(server, http)

        def request_bytes(r: dict, with_weights: bool) -> bytes:
            task = r["lora_task_id"]
            weights, config = adapters[task] if with_weights else (None, None)
            return serialize_request("lora_llm", input_arrays(r["prompt"], r["max_new_tokens"], True, task, weights,
                                                              config))

        prepared, sent = [], {None}                       # an adapter's first request carries it
        for r in requests:                                # the client's requests made before the clock starts
            task = r["lora_task_id"]
            first = task not in sent
            sent.add(task)
            prepared.append(Prepared(request_bytes(r, first), task, uploads=first,
                                     with_weights=None if first or task is None else partial(request_bytes, r, True)))
        bar = tqdm(total=sum(r["max_new_tokens"] for r in requests), desc=workload.name, unit="tok", leave=False,
                   mininterval=2.0)
        client_cpu0 = own_cpu_seconds()
        server_cpu0 = tree_cpu_seconds(server.pid)
        start = time.perf_counter()
        stats = asyncio.run(stream_requests(f"127.0.0.1:{grpc}", prepared, concurrency,
                                            lambda index, ids: bar.update(ids.size)))
        elapsed = time.perf_counter() - start
        server_cpu = tree_cpu_seconds(server.pid) - server_cpu0
        client_cpu = own_cpu_seconds() - client_cpu0
        bar.close()
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics").read().decode()
        steps = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                 if line.startswith(("lora_llm_step_seconds_sum", "lora_llm_step_seconds_count"))}
    finally:
        server.terminate()
        server.wait(timeout=60)
    ttfts, gaps = stats.ttfts, stats.gaps
    return {"tok_s": stats.num_tokens / elapsed, "seconds": elapsed, "output_tokens": stats.num_tokens,
            "concurrency": concurrency,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99), "ttfts_s": ttfts, "itls_s": gaps,
            "steps": sum(v for k, v in steps.items() if "_count" in k),
            "step_seconds": sum(v for k, v in steps.items() if "_sum" in k), **server_step_figures(steps),
            "client_cpu_seconds": client_cpu, "server_cpu_seconds": server_cpu, "adapter_resends": stats.resends}


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a process and its children have used: tritonserver and the models' stubs."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()      # from field 3 (state) on; the name may hold spaces
        except OSError:                                                 # gone meanwhile
            continue
        if int(stat.parent.name) == pid or int(fields[1]) == pid:
            ticks += int(fields[11]) + int(fields[12])                  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def server_step_figures(steps: dict[str, float]) -> dict:
    """bench_engine.step_figures from the server's lora_llm_step_seconds histogram (sums and counts by kind)."""
    def get(stat: str, kind: str) -> float:
        return steps.get(f'lora_llm_step_seconds_{stat}{{kind="{kind}"}}', 0.0)
    num_decode = get("count", "decode")
    return {"decode_step_mean_s": get("sum", "decode") / num_decode if num_decode else float("nan"),
            "num_decode_steps": int(num_decode), "prefill_step_seconds": get("sum", "prefill"),
            "num_prefill_steps": int(get("count", "prefill"))}

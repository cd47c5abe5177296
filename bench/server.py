"""W4: the W1 requests through a real tritonserver, gRPC streaming, at a fixed concurrency. The client makes every
request before the clock starts (serialized, as one holding its adapters in TensorRT-LLM form would); the uploads
themselves (gRPC, tritonserver, parsing in the model) are inside the measured window."""
import asyncio
import os
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from tqdm import tqdm

from bench.engine import own_cpu_seconds, percentile


@contextmanager
def core_server(model_dir: str, workload, dtype: str, kernel_backend: str = "auto", prefetch_dir: Path | None = None):
    """tritonserver with the core model only, set up as the in-process engine is for the workload (with the adapters
    of `prefetch_dir` loaded at start, where given): (process, grpc port, metrics port) until the block ends."""
    from server_process import QUICK_EXIT_TIMEOUT_S, free_ports, start_server, stop_server, wait_ready
    http, grpc, metrics = free_ports(3)
    env = {"LORA_LLM_MODEL_DIR": model_dir, "LORA_LLM_DTYPE": dtype, "LORA_LLM_KERNEL_BACKEND": kernel_backend,
           "LORA_LLM_MAX_LORAS": str(workload.max_loras), "LORA_LLM_MAX_LORA_RANK": str(workload.max_lora_rank),
           "LORA_LLM_MAX_NUM_SEQS": str(workload.max_num_seqs), "LORA_LLM_MAX_NUM_BATCHED_TOKENS": "2048"}
    if prefetch_dir is not None:
        env["LORA_LLM_LORA_PREFETCH_DIR"] = str(prefetch_dir)
    server = start_server(http, grpc, metrics, env=env, log_file=open(f"/tmp/bench_{workload.name}_server.log", "w"),
                          models=["lora_llm"], exit_timeout_s=QUICK_EXIT_TIMEOUT_S)
    try:
        wait_ready(server, http)
        yield server, grpc, metrics
    finally:
        stop_server(server, QUICK_EXIT_TIMEOUT_S)


def run_server_workload(model_dir: str, requests: list[dict], workload, dtype: str, concurrency: int = 32,
                        kernel_backend: str = "auto") -> dict:
    from backend.lora.peft import peft_to_trtllm
    from bench.adapters import adapter_dirs
    from bench.stream import Prepared, serialize_request
    from client.grpc_client import input_arrays

    adapters = {task_id: peft_to_trtllm(path, "float16")
                for task_id, path in enumerate(adapter_dirs(model_dir, workload.adapter_ranks), start=1)}
    with core_server(model_dir, workload, dtype, kernel_backend) as (server, grpc, metrics):
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
        return stream_measured(server, grpc, metrics, prepared, requests, workload, concurrency)


def stream_measured(server, grpc_port: int, metrics_port: int, prepared: list, requests: list[dict], workload,
                    concurrency: int) -> dict:
    """The prepared requests streamed at `concurrency`, timed (measured): the run's figures."""
    from bench.stream import stream_requests
    with measured(server, metrics_port, requests, workload) as run:
        stats = asyncio.run(stream_requests(f"127.0.0.1:{grpc_port}", prepared, concurrency,
                                            lambda index, ids: run.bar.update(ids.size)))
    return run.figures(stats, concurrency) | {"adapter_resends": stats.resends}


def prepared_by_id(requests: list[dict]) -> list:
    """Requests naming their adapters by task id alone (a server that loaded them at start)."""
    from bench.stream import Prepared, serialize_request
    from client.grpc_client import input_arrays
    return [Prepared(serialize_request("lora_llm", input_arrays(r["prompt"], r["max_new_tokens"], True,
                                                                 r["lora_task_id"], end_id=-1)), r["lora_task_id"])
            for r in requests]


@dataclass
class Run:
    """A server run's clock, CPU counters and progress bar; `figures` turns what the client saw into results."""
    server_pid: int
    metrics_port: int
    bar: tqdm
    start: float = field(default_factory=time.perf_counter)
    client_cpu0: float = field(default_factory=lambda: own_cpu_seconds())
    server_cpu0: float = 0.0
    elapsed: float = 0.0
    client_cpu: float = 0.0
    server_cpu: float = 0.0
    others_cpu0: float = 0.0
    others_cpu: float = 0.0                    # of the processes beside tritonserver (the OpenAI frontend)
    steps: dict = field(default_factory=dict)

    def figures(self, stats, concurrency: int) -> dict:
        ttfts, gaps = stats.ttfts, stats.gaps
        return {"tok_s": stats.num_tokens / self.elapsed, "seconds": self.elapsed, "output_tokens": stats.num_tokens,
                "responses": stats.num_responses,
                "concurrency": concurrency,
                "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
                "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99), "ttfts_s": ttfts,
                "itls_s": gaps, "steps": sum(v for k, v in self.steps.items() if "_count" in k),
                "step_seconds": sum(v for k, v in self.steps.items() if "_sum" in k),
                **server_step_figures(self.steps), "client_cpu_seconds": self.client_cpu,
                "server_cpu_seconds": self.server_cpu} | ({"frontend_cpu_seconds": self.others_cpu} if self.others_cpu
                                                          else {})


@contextmanager
def measured(server, metrics_port: int, requests: list[dict], workload, *others):
    """Times the block: wall clock, this process's CPU, the server's (with `others`' process trees, also counted
    apart), its steps."""
    bar = tqdm(total=sum(r["max_new_tokens"] for r in requests), desc=workload.name, unit="tok", leave=False,
               mininterval=2.0)
    others = [p.pid for p in others]
    run = Run(server.pid, metrics_port, bar, server_cpu0=tree_cpu_seconds(server.pid),
              others_cpu0=sum(map(tree_cpu_seconds, others)))
    run.start = time.perf_counter()
    yield run
    run.elapsed = time.perf_counter() - run.start
    run.others_cpu = sum(map(tree_cpu_seconds, others)) - run.others_cpu0
    run.server_cpu = tree_cpu_seconds(server.pid) - run.server_cpu0 + run.others_cpu
    run.client_cpu = own_cpu_seconds() - run.client_cpu0
    bar.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    run.steps = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                 if line.startswith(("lora_llm_step_seconds_sum", "lora_llm_step_seconds_count"))}


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
        return sum(value for key, value in steps.items()
                   if key.startswith(f"lora_llm_step_seconds_{stat}{{") and f'kind="{kind}"' in key)
    num_decode = get("count", "decode")
    return {"decode_step_mean_s": get("sum", "decode") / num_decode if num_decode else float("nan"),
            "num_decode_steps": int(num_decode), "prefill_step_seconds": get("sum", "prefill"),
            "num_prefill_steps": int(get("count", "prefill"))}

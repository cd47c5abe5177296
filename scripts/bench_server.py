"""W4: the W1 requests through a real tritonserver, gRPC streaming, at a fixed concurrency. The client makes every
request's tensors before the clock starts, as one holding its adapters in TensorRT-LLM form would; the uploads
themselves (gRPC, tritonserver, parsing in the model) are inside the measured window."""
import os
import queue
import threading
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm


def run_server_workload(model_dir: str, requests: list[dict], workload, dtype: str, concurrency: int = 32,
                        kernel_backend: str = "auto") -> dict:
    from bench_adapters import adapter_dirs
    from bench_engine import own_cpu_seconds, percentile
    from launch_server import free_ports, start_server, wait_ready

    from backend.lora.peft import peft_to_trtllm
    from client.grpc_client import NOT_FOUND, build_inputs
    import tritonclient.grpc as grpcclient

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
        def inputs_for(r: dict, with_weights: bool) -> list:
            task = r["lora_task_id"]
            weights, config = adapters[task] if with_weights else (None, None)
            return build_inputs(r["prompt"], r["max_new_tokens"], True, task, weights, config)

        todo: queue.Queue = queue.Queue()                 # taken in order: an adapter's first request carries it
        sent: set[int | None] = {None}
        for r in requests:                                # the client's tensors made before the clock starts
            first = r["lora_task_id"] not in sent
            sent.add(r["lora_task_id"])
            todo.put(r | {"with_weights": first, "inputs": inputs_for(r, first)})
        lock = threading.Lock()
        ttfts: list[float] = []
        gaps: list[float] = []
        counts = [0]
        resends = [0]                                     # requests that raced their adapter's upload
        bar = tqdm(total=sum(r["max_new_tokens"] for r in requests), desc=workload.name, unit="tok", leave=False,
                   mininterval=2.0)
        client_cpu0 = own_cpu_seconds()
        server_cpu0 = tree_cpu_seconds(server.pid)
        start = time.perf_counter()

        def one(client, r: dict, with_weights: bool) -> str | None:
            inputs = r["inputs"] if with_weights == r["with_weights"] else inputs_for(r, with_weights)
            responses: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: responses.put((result, error, time.perf_counter())))
            t0 = time.perf_counter()
            client.async_stream_infer("lora_llm", inputs, enable_empty_final_response=True)
            last = None
            try:
                while True:
                    result, error, now = responses.get()
                    if error is not None:
                        return str(error)
                    ids = result.as_numpy("output_ids")
                    if ids is not None and ids.size:
                        with lock:
                            counts[0] += ids.size
                            bar.update(ids.size)
                            (ttfts.append(now - t0) if last is None else gaps.append(now - last))
                        last = now
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        return None
            finally:
                client.stop_stream()

        def worker() -> None:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
            while True:
                try:
                    r = todo.get_nowait()
                except queue.Empty:
                    break
                error = one(client, r, r["with_weights"])
                if error and NOT_FOUND in error:          # raced its adapter's first request: send the weights
                    with lock:
                        resends[0] += 1
                    error = one(client, r, True)
                if error:
                    raise RuntimeError(error)
            client.close()

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        server_cpu = tree_cpu_seconds(server.pid) - server_cpu0
        bar.close()
        client_cpu = own_cpu_seconds() - client_cpu0
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics").read().decode()
        steps = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                 if line.startswith(("lora_llm_step_seconds_sum", "lora_llm_step_seconds_count"))}
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {"tok_s": counts[0] / elapsed, "seconds": elapsed, "output_tokens": counts[0], "concurrency": concurrency,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99), "ttfts_s": ttfts, "itls_s": gaps,
            "steps": sum(v for k, v in steps.items() if "_count" in k),
            "step_seconds": sum(v for k, v in steps.items() if "_sum" in k), **server_step_figures(steps),
            "client_cpu_seconds": client_cpu, "server_cpu_seconds": server_cpu,
            "adapter_resends": resends[0]}


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

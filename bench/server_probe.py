"""What the server checks ask a running server (bench/server_check.py, crash_check.py, server_bench.py): one request
on a gRPC stream with a timeout, a metric, an OpenAI completion, a short perf_analyzer run; and what they read of
the machine: free device memory, the processes alive."""
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 8


def stream(url: str, arrays: dict, model: str = "lora_llm", output: str = "output_ids", cancel_after: int = 0,
           timeout_s: float = 120) -> tuple[list[np.ndarray], str | None]:
    """One request on a gRPC stream: (each response's `output`, the error or None). cancel_after: cancel the stream
    after that many responses. A response that does not come within timeout_s is an error, never a hang."""
    import queue

    import tritonclient.grpc as grpcclient

    from client.grpc_client import DATATYPES
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object
                                       else DATATYPES[array.dtype.type])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    chunks, error = [], None
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            try:
                result, err = responses.get(timeout=timeout_s)
            except queue.Empty:
                return chunks, f"no response within {timeout_s} s"
            if err is not None:
                return chunks, str(err)
            value = result.as_numpy(output)
            if value is not None and value.size:
                chunks.append(value)
            if cancel_after and len(chunks) >= cancel_after:
                return chunks, None
            if result.get_response().parameters["triton_final_response"].bool_param:
                return chunks, None
    finally:
        client.stop_stream(cancel_requests=bool(cancel_after))
        client.close()

def metric(port: int, name: str, label: str) -> float:
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
               and label in line)

def openai_completion(port: int, model: str, prompt_ids: list[int]) -> str:
    import httpx
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    response.raise_for_status()
    return response.json()["choices"][0]["text"]

def free_device_bytes(device: str) -> int | None:
    if device == "cpu":
        return None
    import torch
    return torch.cuda.mem_get_info()[0]

def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process (zombies left out)."""
    out = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] != "Z":
                out[int(proc.name)] = (int(stat[1]), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue
    return out

def perf_analyzer(url: str, vocab: int) -> tuple[bool, str | None]:
    """A short streaming run of perf_analyzer (scripts/run_perf_analyzer.py): (whether it reported a throughput, why
    not)."""
    import re
    import subprocess
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_perf_analyzer.py"), "--url", url,
                          "--vocab-size", str(vocab), "--requests", "8", "--concurrency", "2", "--output-len", "8"],
                         capture_output=True, text=True, timeout=120)
    match = re.search(r"throughput: ([\d.]+) infer/sec", run.stdout)
    if run.returncode == 0 and match:
        print(f"server_check: perf_analyzer: {match.group(0)}", flush=True)
        return True, None
    return False, f"exit {run.returncode}: {(run.stdout + run.stderr)[-1500:]}"

"""W9 and W10: W1's and W2's requests through the OpenAI-compatible API (python -m frontend) beside tritonserver,
`/v1/completions` streamed as server-sent events at a fixed concurrency, prompts as token ids, adapters by name
(the workload's PEFT adapters are the frontend's store, and it sends each one's weights with its first request).
The frontend's CPU counts as the server's; the clock and the client are as in W4 (bench/server.py)."""
import asyncio
import json
import time

import httpx

from bench.server import core_server, measured
from bench.stream import StreamStats


def run_openai_workload(model_dir: str, requests: list[dict], workload, dtype: str, concurrency: int = 32,
                        kernel_backend: str = "auto") -> dict:
    from bench.adapters import adapter_dirs
    from server_process import free_ports, is_ready, start_frontend

    store = adapter_dirs(model_dir, workload.adapter_ranks)[0].parent if workload.adapter_ranks else None
    with core_server(model_dir, workload, dtype, kernel_backend) as (server, grpc, metrics):
        [port] = free_ports(1)
        frontend = start_frontend(model_dir, grpc, port, *(["--adapter-store", str(store)] if store else []),
                                  log_file=open("/tmp/bench_frontend.log", "w"))
        try:
            while not is_ready(port, "/health"):
                if frontend.poll() is not None:
                    raise RuntimeError("the OpenAI frontend exited: see /tmp/bench_frontend.log")
                time.sleep(0.2)
            with measured(server, metrics, requests, workload, frontend) as run:
                stats = asyncio.run(stream_completions(f"http://127.0.0.1:{port}", requests, concurrency,
                                                       lambda: run.bar.update(1)))
        finally:
            frontend.terminate()
            frontend.wait(timeout=30)
    return run.figures(stats, concurrency)


def completion_body(r: dict) -> dict:
    """One workload request as /v1/completions takes it: token ids, greedy, forced to its full length."""
    task = r["lora_task_id"]
    return {"model": "base" if task is None else f"t{task}", "prompt": r["prompt"], "max_tokens": r["max_new_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def stream_completions(url: str, requests: list[dict], concurrency: int, on_token=lambda: None) -> StreamStats:
    """Send `requests` over `concurrency` connections at once, in order; every chunk with text is a token (the
    frontend streams one per engine step), and the usage chunk gives the exact count."""
    stats = StreamStats()
    todo = list(reversed(requests))
    async with httpx.AsyncClient(base_url=url, timeout=None,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        models = (await client.get("/v1/models")).json()["data"]
        base = next(m["id"] for m in models if m["parent"] is None)

        async def worker() -> None:
            while todo:
                body = completion_body(todo.pop())
                body["model"] = base if body["model"] == "base" else body["model"]
                t0, last = time.perf_counter(), None
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()}")
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"]["message"])
                        if chunk.get("usage"):
                            stats.num_tokens += chunk["usage"]["completion_tokens"]
                        elif chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                            now = time.perf_counter()
                            if last is None:
                                stats.ttfts.append(now - t0)
                            else:
                                stats.gaps.append(now - last)
                            last = now
                            on_token()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return stats

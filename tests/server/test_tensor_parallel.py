"""`launch_server.py --tensor_parallel_size 2` (what serve.sh runs) on the tiny model: streamed LoRA requests answer
TP=1's tokens; a worker killed mid-stream gives every open stream an error as its final answer, and the supervisor
brings the whole server back."""
import os
import signal
import subprocess

import numpy as np

from backend import LLMEngine
from backend.lora.peft import peft_to_trtllm
from tests.helpers import random_prompts
from tests.server.streams import Stream, run, trtllm_inputs
from tests.server.test_supervision import read_until, start_launcher

MAX_NEW = 8
TASKS = [1, None, 2, 1]


def worker_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "backend.model.tp_worker"], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


def lora_request(prompt, task, adapters, max_new: int = MAX_NEW) -> dict:
    extra = {}
    if task is not None:
        weights, config = adapters[task]
        extra = {"lora_task_id": np.array([[task]], np.uint64), "lora_weights": weights[None],
                 "lora_config": config[None]}
    return trtllm_inputs(prompt, max_new, True, **extra)


def test_two_ranks_serve_one_rank_tokens_and_a_lost_worker_restarts_the_server(tiny_model_dir, tiny_adapters):
    adapters = {task: peft_to_trtllm(tiny_adapters[task - 1], "float16") for task in (1, 2)}
    prompts = random_prompts([9, 23, 5, 14], 512, seed=61)
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=16,
                       kv_cache_memory_bytes=4 << 20, max_loras=4)
    for task, (weights, config) in adapters.items():
        engine.add_lora(task, weights, config)
    want = engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=TASKS)
    before = set(worker_pids())
    launcher, grpc = start_launcher(tiny_model_dir, "--tensor_parallel_size", "2")
    url, lines = f"127.0.0.1:{grpc}", []
    try:
        read_until(launcher, "ready:", lines)
        workers = sorted(set(worker_pids()) - before)
        assert len(workers) == 1, "one worker process beside rank 0"
        streams = [Stream(url).send(lora_request(p, t, adapters)) for p, t in zip(prompts, TASKS)]
        got = [s.collect() for s in streams]
        assert [r.error for r in got] == [None] * 4 and [r.tokens for r in got] == want

        long = [Stream(url).send(lora_request(p, t, adapters, max_new=400)) for p, t in zip(prompts, TASKS)]
        long[0].wait_first()
        os.kill(workers[0], signal.SIGKILL)
        for stream in long:
            result = stream.collect(timeout_s=60)
            assert result.num_final == 1 and "tensor parallel" in (result.error or "")
        read_until(launcher, "cannot serve", lines)
        read_until(launcher, "ready again after restart 1", lines)
        again = run(url, lora_request(prompts[0], TASKS[0], adapters))
        assert again.error is None and again.tokens == want[0]
        for stream in streams + long:
            stream.close()
    finally:
        launcher.terminate()
        assert launcher.wait(timeout=60) == 0
    assert not set(worker_pids()) - before, "the workers end with the server"

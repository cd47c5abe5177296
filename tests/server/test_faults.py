"""Faults on a real tritonserver fail only what they touch: an engine step that fails (the inject_fault_steps test
hook) and a client that goes away mid-stream; afterwards KV blocks and adapter pins are back to 0 (read from
the metrics port) and the server serves as before."""
import time

import numpy as np
import pytest

from backend import LLMEngine
from backend.lora.peft import peft_to_trtllm
from tests.helpers import random_prompts
from tests.server.conftest import TINY_ENV, run_server
from tests.server.streams import Stream, run, running_stream, trtllm_inputs

FAULT_STEP = 4


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory, tiny_model_dir):
    env = TINY_ENV | {"LORA_LLM_MODEL_DIR": str(tiny_model_dir), "LORA_LLM_INJECT_FAULT_STEPS": str(FAULT_STEP)}
    yield from run_server(tmp_path_factory, "faulty-server", env, models=["lora_llm"])


def lora_inputs(tiny_adapters, task_id: int) -> dict:
    weights, config = peft_to_trtllm(tiny_adapters[0], "float16")
    return {"lora_task_id": np.array([[task_id]], np.uint64), "lora_weights": weights[None],
            "lora_config": config[None]}


def settled(server, timeout_s: float = 20) -> bool:
    """KV blocks and adapter pins back to 0, the engine loop alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (server.metric("lora_llm_kv_blocks", state="used") == 0
                and server.metric("lora_llm_lora_cache", tier="device", stat="pins") == 0
                and server.metric("lora_llm_engine_alive") == 1):
            return True
        time.sleep(0.1)
    return False


def test_a_failed_step_fails_its_requests_only_and_the_server_serves_on(faulty_server, tiny_model_dir, tiny_adapters):
    prompts = random_prompts([12, 20, 9], 512, seed=46)
    streams = [Stream(faulty_server.grpc_url).send(trtllm_inputs(p, 30, True) | lora_inputs(tiny_adapters, 11))
               for p in prompts[:2]]
    results = [s.collect() for s in streams]
    for s in streams:
        s.close()
    assert all(r.num_final == 1 for r in results)
    assert any(r.error and f"injected fault at step {FAULT_STEP}" in r.error for r in results)
    assert settled(faulty_server)
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_block_size=16,
                       kv_cache_memory_bytes=4 << 20, max_loras=4)
    after = run(faulty_server.grpc_url, trtllm_inputs(prompts[2], 8, True, lora_task_id=np.array([[11]], np.uint64)))
    engine.add_lora(11, *peft_to_trtllm(tiny_adapters[0], "float16"))
    assert after.error is None and after.tokens == engine.generate([prompts[2]], 8, lora_task_ids=[11])[0]


def test_a_client_gone_mid_stream_frees_its_blocks_and_adapter_pin(faulty_server, tiny_adapters):
    stream = running_stream(faulty_server.grpc_url, trtllm_inputs([5] * 20, 400, True) | lora_inputs(tiny_adapters, 12),
                            lambda: faulty_server.metric("lora_llm_lora_cache", tier="device", stat="pins") == 1)
    stream.close(cancel=True)
    assert settled(faulty_server)
    assert len(run(faulty_server.grpc_url, trtllm_inputs([5, 6], 3, True)).tokens) == 3

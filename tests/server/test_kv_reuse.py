"""KV cache reuse through a real tritonserver (enable_kv_cache_reuse true): the same tokens as the engine without
reuse, per adapter; the reused blocks in the perf metrics; the hit rate on the metrics port."""
import numpy as np
import pytest

from backend.lora.peft import peft_to_trtllm
from tests.helpers import random_prompts
from tests.server.conftest import TINY_ENV, run_server
from tests.server.streams import Stream, trtllm_inputs

SYSTEM = random_prompts([40], 512, seed=70)[0]            # 2 full blocks of 16, shared
MAX_NEW = 6


@pytest.fixture(scope="module")
def reuse_server(tmp_path_factory, tiny_model_dir):
    env = TINY_ENV | {"LORA_LLM_MODEL_DIR": str(tiny_model_dir), "LORA_LLM_ENABLE_KV_CACHE_REUSE": "true"}
    yield from run_server(tmp_path_factory, "reuse-server", env, models=["lora_llm"])


def generate(url: str, prompt: list[int], task_id: int | None, adapter=None) -> tuple[list[int], int]:
    """(tokens, kv_cache_reused_blocks) of one non-streaming request."""
    extra = {"return_perf_metrics": np.array([[True]]), "exclude_input_in_output": np.array([[True]])}
    if task_id is not None:
        extra["lora_task_id"] = np.array([[task_id]], np.uint64)
    if adapter is not None:
        extra |= {"lora_weights": adapter[0][None], "lora_config": adapter[1][None]}
    stream = Stream(url).send(trtllm_inputs(prompt, MAX_NEW, False, **extra))
    [result] = stream.results()
    stream.close()
    return result.as_numpy("output_ids").reshape(-1).tolist(), int(result.as_numpy("kv_cache_reused_blocks")[0, 0])


def test_reuse_serves_each_adapter_only_its_own_blocks_and_changes_no_token(reuse_server, new_tiny_engine,
                                                                             tiny_adapters):
    engine = new_tiny_engine()                                       # no reuse: the reference
    adapters = {201: peft_to_trtllm(tiny_adapters[0], "float16"), 202: peft_to_trtllm(tiny_adapters[1], "float16")}
    for task_id, (weights, config) in adapters.items():
        engine.add_lora(task_id, weights, config)
    questions = random_prompts([5, 9, 3, 7, 4, 6], 512, seed=71)
    order = [201, None, 202, 201, None, 202]
    sent: set[int] = set()
    got = []
    for task_id, question in zip(order, questions):
        adapter = adapters[task_id] if task_id is not None and task_id not in sent else None
        sent.add(task_id)
        got.append(generate(reuse_server.grpc_url, SYSTEM + question, task_id, adapter))
    want = [engine.generate([SYSTEM + q], max_new_tokens=MAX_NEW, lora_task_ids=[t])[0]
            for t, q in zip(order, questions)]
    assert [tokens for tokens, _ in got] == want
    assert [reused for _, reused in got] == [0, 0, 0, 2, 2, 2]      # each adapter's first request computes
    assert reuse_server.metric("lora_llm_kv_cache_reuse", stat="hits") == 6
    assert reuse_server.metric("lora_llm_kv_cache_reuse", stat="hit_rate") > 0

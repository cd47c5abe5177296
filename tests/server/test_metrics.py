"""TensorRT-LLM's metric families and vLLM's LoRA info gauge on a real tritonserver under load, checked against the
state the test puts the engine in: two sequences running (max_num_seqs 2) on two adapters holding both device slots
(max_loras 2), three waiting, two of them for a slot."""
import re
import time
import urllib.request

import numpy as np
import pytest

from tests.helpers import kv_bytes_for_blocks
from tests.server.conftest import run_server
from tests.server.streams import Stream, trtllm_inputs

pytestmark = pytest.mark.slow
NUM_BLOCKS = 96
PROMPT = list(range(100, 110))


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    from backend.model.checkpoint import ModelConfig
    kv_bytes = kv_bytes_for_blocks(NUM_BLOCKS, 16, ModelConfig.from_dir(smollm2_dir), dtype_bytes=4)
    env = {"LORA_LLM_MODEL_DIR": str(smollm2_dir), "LORA_LLM_DTYPE": "float32", "LORA_LLM_MAX_NUM_SEQS": "2",
           "LORA_LLM_MAX_LORAS": "2", "LORA_LLM_KV_BLOCK_SIZE": "16", "LORA_LLM_KV_CACHE_MEMORY_BYTES": str(kv_bytes)}
    yield from run_server(tmp_path_factory, "metrics-server", env, models=["lora_llm"])


def adapter(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A small random adapter on every layer's q projection of SmolLM2 (rank 4), fp16 as clients send them."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((30, 4 * 576 * 2)) * 0.01).astype(np.float16)
    return weights, np.array([[1, layer, 4] for layer in range(30)], np.int32)


def scrape(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            out[head] = float(value)
    return out


def figure(metrics: dict, family: str, label: str, value: str) -> float:
    [found] = [v for k, v in metrics.items() if k.startswith(family + "{") and f'{label}="{value}"' in k]
    return found


def lora_info(metrics: dict) -> dict[str, str]:
    [head] = [k for k in metrics if k.startswith("vllm:lora_requests_info{")]
    return dict(re.findall(r'(\w+)="([^"]*)"', head))


def has_lora_info(metrics: dict) -> bool:
    """The adapters' series is there: its family is made anew when its labels change, and a scrape can land
    between the old family's end and the new one's first value."""
    return any(k.startswith("vllm:lora_requests_info{") for k in metrics)


def steady(server, want_waiting: int, timeout_s: float = 60) -> dict:
    """A scrape with want_waiting requests waiting and two generating, taken between two gauge updates: the server
    sets its gauges one call at a time, so a scrape can land between KV used and KV free of one step (or between
    the adapters' families, has_lora_info)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = scrape(server)
        kv = {k: figure(m, "nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", k) for k in ("used", "free")}
        if has_lora_info(m) and figure(m, "nv_trt_llm_request_metrics", "request_type", "waiting") == want_waiting and \
                figure(m, "nv_trt_llm_inflight_batcher_metrics", "inflight_batcher_specific_metric",
                       "generation_requests") == 2 and kv["used"] + kv["free"] == NUM_BLOCKS and \
                kv["used"] == m['lora_llm_kv_blocks{model="lora_llm",state="used",version="1"}']:
            return m
        time.sleep(0.2)
    raise AssertionError(f"no steady state: {m}")


def test_trtllm_families_and_the_lora_gauge_follow_the_engine(server):
    streams = []
    try:
        for i, (name, seed) in enumerate([("alpha", 1), ("beta", 2), ("gamma", 3), ("delta", 4), ("alpha", 1)]):
            weights, config = adapter(seed)
            extra = {"lora_task_id": np.array([[seed]], np.uint64), "end_id": np.array([[-1]], np.int32)}
            if i < 4:
                extra |= {"lora_weights": weights[None], "lora_config": config[None]}
            stream = Stream(server.grpc_url).send(trtllm_inputs(PROMPT, 400, True, **extra),
                                                  parameters={"lora_name": name})
            streams.append(stream)
            if i < 2:
                stream.wait_first()                  # alpha and beta hold the two seats and the two slots
        m = steady(server, want_waiting=3)
        request = {k: figure(m, "nv_trt_llm_request_metrics", "request_type", k)
                   for k in ("active", "scheduled", "context", "waiting", "max")}
        assert request == {"active": 2, "scheduled": 2, "context": 0, "waiting": 3, "max": 2}
        kv = {k: figure(m, "nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", k)
              for k in ("tokens_per", "used", "free", "max", "fraction", "reused")}
        assert kv["tokens_per"] == 16 and kv["max"] == NUM_BLOCKS and kv["used"] + kv["free"] == NUM_BLOCKS
        assert kv["used"] == m['lora_llm_kv_blocks{model="lora_llm",state="used",version="1"}']
        assert 2 <= kv["used"] <= 2 * -(-(len(PROMPT) + 400) // 16) and kv["fraction"] == pytest.approx(
            kv["used"] / NUM_BLOCKS) and kv["reused"] == 0
        batcher = {k: figure(m, "nv_trt_llm_inflight_batcher_metrics", "inflight_batcher_specific_metric", k)
                   for k in ("total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests")}
        assert batcher == {"total_context_tokens": 0, "generation_requests": 2, "micro_batch_id": 0,
                           "paused_requests": 0}
        assert abs(figure(m, "nv_trt_llm_general_metrics", "general_type", "timestamp") - time.time()) < 60
        time.sleep(1)
        later = steady(server, want_waiting=3)
        assert figure(later, "nv_trt_llm_general_metrics", "general_type", "iteration_counter") > \
            figure(m, "nv_trt_llm_general_metrics", "general_type", "iteration_counter")
        assert figure(m, "nv_trt_llm_runtime_memory_metrics", "memory_type", "cpu") > 538e6   # fp32 weights alone
        assert figure(m, "nv_trt_llm_runtime_memory_metrics", "memory_type", "gpu") == 0
        info = lora_info(m)
        assert info == {"max_lora": "2", "running_lora_adapters": "alpha,beta", "waiting_lora_adapters": "delta,gamma",
                        "model": "lora_llm", "version": "1"}                    # alpha's waiting request has its slot
        assert abs(m[next(k for k in m if k.startswith("vllm:"))] - time.time()) < 10
    finally:
        for stream in streams:
            stream.close(cancel=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = scrape(server)
        if figure(m, "nv_trt_llm_request_metrics", "request_type", "active") == 0 and \
                figure(m, "nv_trt_llm_request_metrics", "request_type", "waiting") == 0 and has_lora_info(m):
            break
        time.sleep(0.2)
    assert figure(m, "nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "used") == 0
    assert lora_info(m)["waiting_lora_adapters"] == "" and len([k for k in m if k.startswith("vllm:")]) == 1

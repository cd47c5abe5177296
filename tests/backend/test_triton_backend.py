"""The whole engine on the Triton kernels (interpreter on CPU) gives the torch path's greedy tokens."""
import pytest

from backend import LLMEngine
from tests.helpers import KERNEL_DEVICES, random_prompts

TASKS = [1, None, 2, 1, 2]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_triton_engine_equals_torch_engine_with_two_adapters(tiny_model_dir, tiny_adapters, dtype, device):
    if device == "cuda" and dtype != "float32":
        pytest.skip("fp16 on a GPU rounds differently from torch's matmuls; the GPU case checks fp32 exactly")
    prompts = random_prompts([7, 21, 12, 3, 30], 512, seed=50)
    outputs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(tiny_model_dir, dtype=dtype, kernel_backend=backend, device=device,
                           kv_cache_memory_bytes=1 << 20,
                           max_num_batched_tokens=24)     # chunked prefill next to decodes: both kernels run
        assert engine.runner.ops.name == backend
        engine.add_lora_dir(1, tiny_adapters[0])
        engine.add_lora_dir(2, tiny_adapters[2])
        outputs[backend] = engine.generate(prompts, max_new_tokens=6, lora_task_ids=TASKS, end_id=2)
    assert outputs["triton"] == outputs["torch"]

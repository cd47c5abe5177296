"""The whole engine on the Triton kernels gives the torch path's greedy tokens: fp16 in the interpreter, fp32 on a
GPU (fp16 on a GPU rounds differently from torch's matmuls). fp32 in the interpreter is held against PEFT by
test_dora.py and test_families.py (their Triton cases: adapters, base rows, chunked prompts beside decodes)."""
import pytest

from backend import LLMEngine
from tests.helpers import CUDA_MARKS, INTERPRETER_MARK, random_prompts

TASKS = [1, None, 2, 1, 2]


@pytest.mark.parametrize("dtype,device", [pytest.param("float16", "cpu", marks=INTERPRETER_MARK),
                                          pytest.param("float32", "cuda", marks=CUDA_MARKS)])
def test_triton_engine_equals_torch_engine_with_two_adapters(tiny_model_dir, tiny_adapters, dtype, device):
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

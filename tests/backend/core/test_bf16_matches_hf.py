"""The optimized CPU paths in bf16 (packed batch, LoRA grid of decode steps, paged decode attention; the torch
reference and the compiled kernels, whose GEMMs run on AMX tiles where the CPU has them) against transformers + PEFT
in bf16 on SmolLM2."""
import pytest
import torch

from backend import LLMEngine
from tests.helpers import ADAPTER_SPECS, CPU_BACKENDS, make_peft_adapters, peft_greedy, peft_model_with

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Water boils at a temperature of",
           "The three primary colors are", "Once upon a time, in a small village,", "import numpy as np\n",
           "The largest planet in our solar system is", "To make a cup of tea, first"]
TASKS = [1, 2, 3, None, 1, 2, 3, None]
MAX_NEW = 8


@pytest.mark.slow
@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_smollm2_bf16_batch_matches_transformers_bf16(smollm2_dir, tmp_path, kernel_backend):
    """Tolerance: bf16 rounds differently in the two (fused projections, the LoRA scale folded into B, batched
    adapter matmuls), so a greedy path may part after a near tie. Required: every first token agrees, and the
    first 4 tokens agree for at least 7 of the 8 requests."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    adapters = make_peft_adapters(smollm2_dir, tmp_path, specs=ADAPTER_SPECS[:3], scale=0.05)
    peft = peft_model_with(smollm2_dir, adapters, dtype=torch.bfloat16)
    expected = [peft_greedy(peft, p, "__base__" if t is None else f"a{t - 1}", MAX_NEW) for p, t in zip(prompts, TASKS)]
    engine = LLMEngine(smollm2_dir, dtype="bfloat16", kernel_backend=kernel_backend, kv_cache_memory_bytes=64 << 20,
                       max_loras=4)
    for task_id, path in enumerate(adapters, start=1):
        engine.add_lora_dir(task_id, path)
    got = engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=TASKS, end_id=tokenizer.eos_token_id)
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert sum(g[:4] == e[:4] for g, e in zip(got, expected)) >= 7, (got, expected)

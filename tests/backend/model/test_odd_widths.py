"""A model whose LoRA band widths are no multiple of 16 (an intermediate size of 344 = 8 x 43, a head dim of 72 over
3 query heads and 1 KV head: q 216, k and v 72 columns), served with adapters on every CPU path and the Triton
kernels (the interpreter), token for token as PEFT gives it in fp32: ranks 4-64 on every module, a DoRA adapter,
base rows beside them."""
import pytest

from backend import LLMEngine
from scripts.prepare_model import build_tiny
from tests.helpers import (ALL_MODULES, CPU_BACKENDS, INTERPRETER_MARK, make_peft_adapters, peft_greedy_alone,
                           peft_model_with, random_prompts)

SHAPE = dict(hidden_size=96, intermediate_size=344, num_attention_heads=3, num_key_value_heads=1, head_dim=72)
SPECS = [dict(r=4, lora_alpha=8, target_modules=ALL_MODULES), dict(r=64, lora_alpha=32, target_modules=ALL_MODULES),
         dict(r=16, lora_alpha=16, use_dora=True, target_modules=ALL_MODULES)]
TASKS = [None, 1, 2, 3, 2]
MAX_NEW = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("odd-widths")
    build_tiny(path, seed=7, architecture="llama", **SHAPE)
    return path


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    return make_peft_adapters(model_dir, tmp_path_factory.mktemp("adapters"), specs=SPECS, seed=3)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([7, 21, 12, 40, 5], 512, seed=8)


@pytest.fixture(scope="module")
def expected(model_dir, adapters, prompts):
    peft = peft_model_with(model_dir, adapters)
    return [peft_greedy_alone(peft, p, None if t is None else f"a{t - 1}", MAX_NEW) for p, t in zip(prompts, TASKS)]


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS + [pytest.param("triton", marks=INTERPRETER_MARK)])
def test_adapters_on_widths_no_multiple_of_16_match_peft(model_dir, adapters, prompts, expected, kernel_backend):
    engine = LLMEngine(model_dir, dtype="float32", kernel_backend=kernel_backend, kv_cache_memory_bytes=1 << 20,
                       max_num_batched_tokens=32)
    for task_id, path in enumerate(adapters, start=1):
        engine.add_lora_dir(task_id, path)
    assert not engine.runner.kernel_fallbacks
    assert engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=TASKS, ignore_end_id=True) == expected
    assert len({tuple(t) for t in expected}) == len(expected)                    # every adapter changes the tokens

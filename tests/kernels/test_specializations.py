"""A varied workload launches each kernel configuration with one specialization: Triton compiles a variant per
distinct (int == 1, int divisible by 16, pointer 16-byte aligned) pattern of its arguments, on the engine thread,
the first time a step produces it. Launches are recorded through the interpreter and keyed as the runtime keys
them; the per-step ints (kernels/metadata.UNSPECIALIZED_ARGS) are not specialized."""
import inspect

import pytest
import torch

from backend import LLMEngine
from kernels import fused, paged_attention
from kernels.lora import triton_kernels as lora
from kernels.metadata import UNSPECIALIZED_ARGS
from tests.helpers import INTERPRETER_MARK, random_prompts

KERNELS = [(paged_attention, "_attention_kernel"), (lora, "_shrink_kernel"), (lora, "_expand_kernel"),
           (fused, "_add_rms_norm_kernel"), (fused, "_silu_and_mul_kernel"), (fused, "_rotary_and_cache_kernel")]
# (the split reduce runs only where there are SMs to fill; its ints are the output's fixed strides)


def specialization(name: str, value, fixed: tuple[str, ...]):
    """What Triton's launcher keys a compiled variant on, for one runtime argument."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype), value.data_ptr() % 16 == 0
    if isinstance(value, bool) or isinstance(value, float) or name in fixed:
        return type(value).__name__
    return value == 1, value % 16 == 0


class Recorder:
    """Stands in for a kernel: records each launch's specialization key by its constexpr configuration."""

    def __init__(self, kernel, name: str):
        self.kernel, self.name = kernel, name
        self.params = list(inspect.signature(kernel.fn).parameters)
        self.keys: dict[tuple, set] = {}

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            fixed = UNSPECIALIZED_ARGS.get(self.name, ())
            key = tuple(specialization(n, v, fixed) for n, v in zip(self.params, args))
            self.keys.setdefault(tuple(sorted(constexprs.items())), set()).add(key)
            return self.kernel[grid](*args, **constexprs)
        return launch


@INTERPRETER_MARK
def test_a_varied_workload_compiles_each_configuration_once(tiny_model_dir, tiny_adapters, monkeypatch):
    recorders = []
    for module, name in KERNELS:
        recorder = Recorder(getattr(module, name), name)
        monkeypatch.setattr(module, name, recorder)
        recorders.append(recorder)
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="triton", kv_cache_memory_bytes=1 << 20,
                       max_num_batched_tokens=24, max_num_seqs=6)
    engine.add_lora_dir(1, tiny_adapters[0])
    engine.add_lora_dir(2, tiny_adapters[2])
    lengths = [1, 9, 16, 17, 3, 33, 40, 5]                # sequence counts and block-table widths of every kind
    prompts = random_prompts(lengths, 512, seed=71)
    engine.generate(prompts, max_new_tokens=5, lora_task_ids=[1, None, 2, 1, 2, None, 1, 2])
    engine.generate(prompts[:1], max_new_tokens=3)        # one sequence alone: num_seqs == 1
    for recorder in recorders:
        assert recorder.keys, f"{recorder.name} never ran"
        for config, keys in recorder.keys.items():
            assert len(keys) == 1, f"{recorder.name} {dict(config)}: {len(keys)} specializations {sorted(keys)}"

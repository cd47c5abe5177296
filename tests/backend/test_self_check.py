"""The start-up self-check (backend/model/self_check.py) through the interpreter: it passes at the tiny model's
and SmolLM2's shapes; a kernel broken on purpose (wrong values, an error at launch) moves its family to the torch
reference, with the metric showing it and the tokens still the reference's; a graph whose step differs from the
eager one turns graphs off; strict refuses to start, naming the kernel."""
import pytest
import torch

import kernels.triton_ops as triton_ops
from backend import LLMEngine
from backend.metrics import gauges
from backend.model.config import ModelConfig
from backend.model.graphs import DecodeGraphs
from backend.model.piecewise import PiecewiseGraphs
from backend.model.self_check import check_graphs, check_kernels, check_piecewise_graphs
from kernels.dispatch import load_ops
from tests.helpers import INTERPRETER_MARK, hf_greedy, random_prompts

pytestmark = INTERPRETER_MARK
PROMPTS = random_prompts([7, 21, 12], 512, seed=81)


def wrong_values(kernel):
    return lambda *args, **kwargs: kernel(*args, **kwargs) * 1.5


def raises_at_launch(*args, **kwargs):
    raise RuntimeError("CUDA error: too many resources requested for launch")


def lora_wrong_values(x, proj, segments, out):
    triton_ops.lora_apply(x, proj, segments, out)
    out.mul_(1.5)


def rotary_without_cache_write(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
    return FAULTS_ORIGINAL(q, k, v, positions, cos_sin, k_cache.clone(), v_cache.clone(), slot_mapping)


FAULTS_ORIGINAL = triton_ops.rotary_and_cache
FAULTS = {"attention wrong": ("paged_attention", wrong_values(triton_ops.paged_attention), "attention"),
          "attention launch": ("paged_attention", raises_at_launch, "attention"),
          "lora wrong": ("lora_apply", lora_wrong_values, "lora"),
          "lora launch": ("lora_apply", raises_at_launch, "lora"),
          "fused no cache write": ("rotary_and_cache", rotary_without_cache_write, "fused")}


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_kernels_pass_at_the_served_shapes(model, tiny_model_dir, smollm2_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir if model == "tiny" else smollm2_dir)
    checks = check_kernels(load_ops("triton"), cfg, torch.float32, torch.float16, torch.device("cpu"), 16, 64, True)
    assert {c.family for c in checks} == {"attention", "lora", "fused"} and len(checks) >= 10
    assert [(c.what, c.error) for c in checks if c.error] == []


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_broken_kernel_falls_back_and_the_tokens_stay_right(fault, tiny_model_dir, hf_tiny, monkeypatch):
    name, broken, family = FAULTS[fault]
    monkeypatch.setattr(triton_ops, name, broken)
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="triton", kernel_self_check="true",
                       kv_cache_memory_bytes=1 << 20)
    assert set(engine.runner.kernel_fallbacks) == {family}
    exported = gauges(engine, alive=True)
    assert exported[("lora_llm_kernel_fallback", (("kernel", family),))] == 1
    assert sum(v for (f, _), v in exported.items() if f == "lora_llm_kernel_fallback") == 1
    assert engine.generate(PROMPTS, max_new_tokens=6) == [hf_greedy(hf_tiny, p, 6) for p in PROMPTS]


def test_a_broken_lora_kernel_falls_back_and_adapters_stay_right(tiny_model_dir, tiny_adapters, monkeypatch):
    def engine(backend):
        e = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend=backend, kernel_self_check="true",
                      kv_cache_memory_bytes=1 << 20)
        for task_id, path in enumerate(tiny_adapters[:2], start=1):
            e.add_lora_dir(task_id, path)
        return e
    want = engine("torch").generate(PROMPTS, max_new_tokens=6, lora_task_ids=[1, None, 2])
    monkeypatch.setattr(triton_ops, "lora_apply", lora_wrong_values)
    broken = engine("triton")
    assert set(broken.runner.kernel_fallbacks) == {"lora"}
    assert broken.generate(PROMPTS, max_new_tokens=6, lora_task_ids=[1, None, 2]) == want


def test_strict_refuses_to_start_naming_the_kernel(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(triton_ops, "paged_attention", raises_at_launch)
    with pytest.raises(RuntimeError, match="kernel_self_check strict: the attention kernel failed .*too many "
                                           "resources"):
        LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="triton", kernel_self_check="strict",
                  kv_cache_memory_bytes=1 << 20)


def test_a_graph_that_differs_from_the_eager_step_is_caught(tiny_model_dir):
    """On CPU the graphs run their padded fixed-buffer steps without capture (backend/model/graphs.py): the check
    passes on them as they are, and catches a replay that returns other logits."""
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="triton", kv_cache_memory_bytes=1 << 20)
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, engine.lora_cache.slots, 4, runner.block_size,
                                 runner.device, capture=False)
    assert check_graphs(runner, engine.lora_cache) is None
    replay = runner.graphs.run
    runner.graphs.run = lambda *args: replay(*args) + 0.5 * torch.arange(replay(*args).shape[-1])
    assert "max logit error" in check_graphs(runner, engine.lora_cache)


def test_piecewise_graphs_whose_step_differs_from_the_eager_step_are_caught(tiny_model_dir):
    """The same for the pieces of steps with prompt chunks (backend/model/piecewise.py)."""
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="triton", kv_cache_memory_bytes=1 << 20)
    runner = engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, runner.kv_caches, engine.lora_cache.slots, 64, runner.device,
                                       capture=False)
    assert check_piecewise_graphs(runner, engine.lora_cache) is None
    pieces = runner.piecewise.run
    runner.piecewise.run = lambda *args: pieces(*args) + 0.5 * torch.arange(pieces(*args).shape[-1])
    assert "a step of 3 prompts: max logit error" in check_piecewise_graphs(runner, engine.lora_cache)


def test_tensor_parallel_workers_take_rank_0s_verdict(tiny_model_dir, hf_tiny, monkeypatch):
    """The check runs on rank 0's device before the workers start; they serve the same families by the reference."""
    monkeypatch.setattr(triton_ops, "paged_attention", raises_at_launch)
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="triton", kernel_self_check="true",
                       kv_cache_memory_bytes=1 << 20, tensor_parallel_size=2)
    try:
        assert set(engine.runner.kernel_fallbacks) == {"attention"}
        assert engine.generate(PROMPTS, max_new_tokens=4) == [hf_greedy(hf_tiny, p, 4) for p in PROMPTS]
    finally:
        engine.close()

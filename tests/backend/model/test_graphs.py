"""CUDA graphs of decode steps (backend/model/graphs.py): the padded fixed-buffer steps a graph records give the
eager steps' tokens (run eagerly on CPU, through the Triton interpreter; captured and replayed on CUDA), and a
decode step launches a fixed, small number of kernels."""
from types import SimpleNamespace

import pytest
import torch

from backend import LLMEngine
from backend.model import graphs as graphs_module
from backend.model.graphs import DecodeGraphs, bucket_sizes
from tests.helpers import INTERPRETER_MARK, needs_cuda, random_prompts

TASKS = [1, None, 2, 1, None]
MAX_NEW_TOKENS = [9, 3, 6, 2, 7]                      # sequences leave one by one: steps of 5, 4, 3, 2, 1


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    ids = [engine.add_request(prompt, lora=task, max_new_tokens=n)
           for prompt, task, n in zip(prompts, TASKS, MAX_NEW_TOKENS)]
    outputs = {request_id: [] for request_id in ids}
    while engine.has_unfinished:
        for out in engine.step():
            assert not out.error, out.error
            outputs[out.request_id] += out.new_token_ids
    return [outputs[request_id] for request_id in ids]


def make_engine(model_dir, adapters, device: str, **kwargs) -> LLMEngine:
    engine = LLMEngine(model_dir, dtype="float32", kernel_backend="triton", device=device, max_num_seqs=6,
                       kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=80, **kwargs)
    engine.add_lora_dir(1, adapters[0])
    engine.add_lora_dir(2, adapters[1])
    return engine


def count_graph_steps(graphs: DecodeGraphs) -> list[int]:
    """Wrap graphs.run: the buckets of the steps that went through it."""
    buckets, run_graph = [], graphs.run
    def counted(bucket, *args):
        buckets.append(bucket[0])
        return run_graph(bucket, *args)
    graphs.run = counted
    return buckets


def test_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert bucket_sizes(1) == [1]


@INTERPRETER_MARK
def test_a_step_replays_the_graph_of_its_rows_and_its_longest_context(tiny_model_dir, tiny_adapters):
    """Graphs per bucket and context class (256 tokens, then the model's 512): the class fixes the split count."""
    engine = make_engine(tiny_model_dir, tiny_adapters, "cpu")
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, engine.lora_cache.slots, 6, runner.block_size,
                          runner.device, capture=False)
    assert graphs.contexts == [256, 512]
    assert set(graphs.splits) == {(rows, context) for rows in bucket_sizes(6) for context in (256, 512)}

    def step_of(seq_lens):
        inputs = SimpleNamespace(seq_lens=seq_lens, max_query_len=1, runs_eager=False,
                                 tensors={"logits_indices": torch.zeros(len(seq_lens))})
        return graphs.bucket_for(inputs)
    assert step_of([30, 256, 7]) == (4, 256) and step_of([257]) == (1, 512) and step_of([5] * 6) == (6, 256)


@INTERPRETER_MARK
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_padded_decode_steps_give_the_eager_steps_tokens(tiny_model_dir, tiny_adapters, monkeypatch, kv_cache_dtype):
    """Every decode step padded to its bucket (padding rows write no cache slot and read no context), with the
    attention's split count and the LoRA segment count fixed as a graph needs them: same tokens as eager steps, their
    greedy tokens taken in the graph (the sampler takes no argmax of its own). A step of the same sequences as the one
    before leaves the LoRA buffers as they are. An INT8 cache's scales go into the graph's launches alike."""
    from backend.core import sampler
    prompts = random_prompts([7, 21, 12, 3, 30], 512, seed=51)
    want = run(make_engine(tiny_model_dir, tiny_adapters, "cpu", kv_cache_dtype=kv_cache_dtype), prompts)
    engine = make_engine(tiny_model_dir, tiny_adapters, "cpu", kv_cache_dtype=kv_cache_dtype)
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, engine.lora_cache.slots, 6, runner.block_size,
                                 runner.device, capture=False)
    buckets = count_graph_steps(runner.graphs)
    copies, copy_lora = [], graphs_module.copy_lora
    monkeypatch.setattr(graphs_module, "copy_lora", lambda *args: (copies.append(len(buckets)), copy_lora(*args)))
    argmaxes, greedy = [], sampler.greedy
    monkeypatch.setattr(sampler, "greedy", lambda logits: argmaxes.append(len(buckets)) or greedy(logits))
    assert run(engine, prompts) == want
    assert {6, 4, 2, 1} <= set(buckets), buckets
    assert len(argmaxes) == engine.num_steps - len(buckets)             # the steps with prompt tokens only
    assert 0 < len(copies) < len(buckets) and len(set(copies)) == len(copies), (copies, buckets)   # not every step


@INTERPRETER_MARK
@pytest.mark.parametrize("with_adapters,graph,fold", [(False, False, True), (True, False, True), (True, True, False),
                                                      (True, True, True)])
def test_a_decode_step_launches_a_fixed_number_of_kernels(tiny_model_dir, tiny_adapters, with_adapters, graph, fold):
    """Per layer: two add + RMSNorm, RoPE with the cache write, attention, SiLU-and-mul and, with adapters, one
    shrink and one expand per projection (4 x 2). A graph step runs LoRA beside the GEMMs, into a delta: merged
    after each GEMM (4 x 3), or (fold) added by the op after each GEMM as it loads its output (4 x 2): only the
    last layer's down is merged (its output goes to the final norm of a few rows). Then the final norm. GEMMs are
    torch's (not counted)."""
    from triton.runtime.interpreter import GridExecutor
    engine = make_engine(tiny_model_dir, tiny_adapters, "cpu", lora_fold=fold)
    num_layers = engine.model_config.num_layers
    if graph:
        runner = engine.runner
        runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, engine.lora_cache.slots, 6, runner.block_size,
                                     runner.device, capture=False)
        buckets = count_graph_steps(runner.graphs)
    task = 1 if with_adapters else None
    for prompt in random_prompts([5, 9, 4], 512, seed=52):
        engine.add_request(prompt, lora=task, max_new_tokens=4)
    engine.step()                                     # the prompts
    launches, call = [], GridExecutor.__call__
    def counted(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return call(self, *args, **kwargs)
    GridExecutor.__call__ = counted
    try:
        engine.step()                                 # a decode step of three sequences
    finally:
        GridExecutor.__call__ = call
    merges = (1 if fold else 4 * num_layers) if graph else 0
    per_layer = 5 + (8 if with_adapters else 0)
    assert len(launches) == num_layers * per_layer + merges + 1, launches
    assert launches.count("_merge_kernel") == merges
    assert not graph or buckets == [4]


@needs_cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_graph_replays_give_the_eager_steps_tokens(tiny_model_dir, tiny_adapters, kv_cache_dtype):
    prompts = random_prompts([7, 21, 12, 3, 30], 512, seed=51)
    want = run(make_engine(tiny_model_dir, tiny_adapters, "cuda", cuda_graph_mode=False,
                           kv_cache_dtype=kv_cache_dtype), prompts)
    engine = make_engine(tiny_model_dir, tiny_adapters, "cuda", lora_fold=False, kv_cache_dtype=kv_cache_dtype)
    assert not engine.runner.kernel_fallbacks and engine.runner.ops.lora.overlap     # LoRA beside the GEMMs
    graphs = engine.runner.graphs              # each bucket and context class, with and without adapters
    assert len(graphs.graphs) == 2 * len(bucket_sizes(6)) * len(graphs.contexts)
    buckets = count_graph_steps(engine.runner.graphs)
    assert run(engine, prompts) == want
    assert {6, 4, 2, 1} <= set(buckets), buckets


@needs_cuda
def test_graphs_whose_overlapped_lora_fails_are_captured_again_without_it(tiny_model_dir, tiny_adapters,
                                                                          monkeypatch):
    """LoRA beside the GEMMs that loses its delta inside a capture only (the eager self-check passes): the graph
    check sees the graphed step differ, the graphs are captured again with LoRA after each GEMM, and serve. (Every
    product merged: lora_fold false.)"""
    from kernels.lora import executor
    merge = executor.lora_merge
    monkeypatch.setattr(executor, "lora_merge", lambda proj, p, out: None if torch.cuda.is_current_stream_capturing()
                        else merge(proj, p, out))
    prompts = random_prompts([7, 21, 12, 3, 30], 512, seed=53)
    want = run(make_engine(tiny_model_dir, tiny_adapters, "cuda", cuda_graph_mode=False), prompts)
    engine = make_engine(tiny_model_dir, tiny_adapters, "cuda", lora_fold=False)
    assert set(engine.runner.kernel_fallbacks) == {"lora_overlap"}, engine.runner.kernel_fallbacks
    assert engine.runner.graphs is not None and not engine.runner.ops.lora.overlap
    buckets = count_graph_steps(engine.runner.graphs)
    assert run(engine, prompts) == want and buckets


@needs_cuda
def test_graphs_whose_folded_lora_fails_are_captured_again_merging(tiny_model_dir, tiny_adapters, monkeypatch):
    """The product left for the next op lost inside a capture only (the eager self-check passes): the graph check
    sees the graphed step differ, the graphs are captured again with each product merged after its GEMM (LoRA
    still beside the GEMMs), and serve."""
    from kernels.lora.executor import TritonLoraExecutor
    deferred = TritonLoraExecutor.linear_deferred

    def lost_in_capture(*args):
        out, delta = deferred(*args)
        return out, None if torch.cuda.is_current_stream_capturing() else delta
    monkeypatch.setattr(TritonLoraExecutor, "linear_deferred", lost_in_capture)
    prompts = random_prompts([7, 21, 12, 3, 30], 512, seed=54)
    want = run(make_engine(tiny_model_dir, tiny_adapters, "cuda", cuda_graph_mode=False), prompts)
    engine = make_engine(tiny_model_dir, tiny_adapters, "cuda", lora_fold=False)
    assert set(engine.runner.kernel_fallbacks) == {"lora_fold"}, engine.runner.kernel_fallbacks
    lora = engine.runner.ops.lora
    assert engine.runner.graphs is not None and lora.overlap and not lora.fold
    buckets = count_graph_steps(engine.runner.graphs)
    assert run(engine, prompts) == want and buckets

"""Tensor parallelism in process on CPU (gloo, the workers as real processes): TP=2 and TP=4 answer TP=1's tokens
for the base model and a mixed batch of adapters through every feature the engine has; each module's adapter
shares recombine to PEFT's LoRA delta; a worker that dies fails the step with a clear error."""
import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from backend import LLMEngine
from backend import device as device_module
from backend.lora.format import LoraAdapter, parse_lora
from backend.lora.peft import load_lora_dir
from backend.lora.shard import ROW_MODULES, shard_adapter
from backend.model.checkpoint import ModelConfig
from backend.model.loader import load_weights
from backend.model.parallel import TensorParallelGroup
from backend.model.runner import ModelRunner
from backend.serving.loop import EngineLoop
from backend.text import load_tokenizer
from tests.backend.serving.loop_streams import FakeStream, prompts
from tests.backend.lora.test_lora_trtllm import hand_built_adapter
from tests.helpers import (CPU_BACKENDS, INTERPRETER_MARK, build_tiny, cpu_kernels_build, hf_greedy,
                           kv_bytes_for_blocks, peft_greedy, peft_model_with, random_prompts)

LOGITS_ATOL = 1e-4             # fp32: the all-reduce adds the ranks' partial sums in another order than one GEMM
PEFT_MODULES = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
# request i: adapter TASKS[i] (None: base), options OPTIONS.get(i); request ABORTED stops after two tokens
TASKS = [1, 2, None, 3, 4, 1, 3, None, 2, 4]
LENGTHS = [40, 21, 9, 14, 33, 3, 17, 26, 11, 8]
OPTIONS = {1: dict(num_return_sequences=2, temperature=0.9, top_k=20, seed=7), 2: dict(return_context_logits=True),
           4: dict(return_generation_logits=True), 6: dict(temperature=1.1, top_p=0.8, seed=3, return_log_probs=True)}
ABORTED = 8
SHARED_PREFIX = (0, 9)         # request 9 starts with request 0's first 32 tokens: a KV reuse hit
GREEDY = [i for i in range(len(TASKS)) if i not in OPTIONS and i != ABORTED]


@pytest.fixture(scope="module")
def tiny_peft(tiny_model_dir, tiny_adapters):
    return peft_model_with(tiny_model_dir, tiny_adapters)


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("module", list(PEFT_MODULES))
def test_adapter_shares_recombine_to_peft_delta(tiny_model_dir, tiny_adapters, tiny_peft, module, tp_size):
    """Column-parallel modules: each rank's B rows give its output columns (k, v by KV heads, a head on two ranks
    at TP=4); row-parallel ones: each rank's A columns over its input slice give partial sums that add up."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    adapter = parse_lora(*load_lora_dir(tiny_adapters[0]), cfg, torch.float32, 64, 1 << 30)
    layer, module_id = 1, PEFT_MODULES[module]
    parent = tiny_peft.base_model.model.model.layers[layer]
    peft_module = getattr(parent.self_attn if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else
                          parent.mlp, module)
    x = torch.randn(5, peft_module.in_features, generator=torch.Generator().manual_seed(module_id))
    with torch.no_grad():
        want = peft_module.lora_B["a0"](peft_module.lora_A["a0"](x)) * peft_module.scaling["a0"]
    shares = [shard_adapter(adapter, cfg, tp_size, rank).weights[(layer, module_id)] for rank in range(tp_size)]
    if module_id in ROW_MODULES:
        got = sum(x_r @ a.T @ b.T for x_r, (a, b) in zip(x.chunk(tp_size, dim=1), shares))
    else:
        outputs = [x @ a.T @ b.T for a, b in shares]
        if module_id in (2, 3):                  # a KV head's ranks hold the same part: take one of each
            parts = {cfg.kv_head_part(tp_size, rank)[1]: out for rank, out in enumerate(outputs)}
            outputs = [parts[i] for i in sorted(parts)]
        got = torch.cat(outputs, dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_qkv_adapter_splits_q_k_v_each_by_heads(tiny_model_dir):
    """A TensorRT-LLM attn_qkv module (one A, B over q, k, v) splits each of q, k, v on its own, as the fused
    base weight does."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    a, b = torch.randn(8, cfg.hidden_size), torch.randn(cfg.q_size + 2 * cfg.kv_size, 8)
    for tp_size in (2, 4):
        shard = cfg.shard(tp_size)
        for rank in range(tp_size):
            a_r, b_r = shard_adapter(LoraAdapter({(0, 0): (a, b)}), cfg, tp_size, rank).weights[(0, 0)]
            q, k, v = b.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            num_parts, index, _ = cfg.kv_head_part(tp_size, rank)
            assert torch.equal(a_r, a)
            assert torch.equal(b_r, torch.cat([q.chunk(tp_size)[rank], k.chunk(num_parts)[index],
                                               v.chunk(num_parts)[index]]))
            assert b_r.shape[0] == shard.q_size + 2 * shard.kv_size


def run_scenario(engine: LLMEngine, adapters) -> tuple[dict, dict]:
    """Staggered arrivals over four adapters in two slots, a KV pool small enough to preempt, n=2, sampling with
    seeds, both kinds of logits, KV reuse, an abort: (tokens, logits) by (request, sequence)."""
    for task_id, path in enumerate(adapters, start=1):
        engine.add_lora_dir(task_id, path)
    prompts = scenario_prompts(engine.model_config.vocab_size)
    tokens, logits = {}, {}
    pending = list(range(len(prompts)))
    while pending or engine.has_unfinished:
        if pending:
            i = pending.pop(0)
            engine.add_request(prompts[i], request_id=i, lora=TASKS[i], max_new_tokens=12, end_id=None,
                               **OPTIONS.get(i, {}))
        for out in engine.step():
            assert out.error is None, out.error
            key = (out.request_id, out.sequence_index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            for kind in ("generation_logits", "context_logits"):
                if getattr(out, kind) is not None:
                    logits.setdefault((*key, kind), []).append(getattr(out, kind))
            if out.request_id == ABORTED and len(tokens[key]) == 2:
                assert engine.abort(ABORTED)
    return tokens, logits


def scenario_prompts(vocab_size: int) -> list[list[int]]:
    prompts = random_prompts(LENGTHS, vocab_size, seed=31)
    first, later = SHARED_PREFIX
    prompts[later] = prompts[first][:32] + prompts[later]
    return prompts


def scenario_engine(model_dir, tp_size: int, kernel_backend: str) -> LLMEngine:
    cfg = ModelConfig.from_dir(model_dir).shard(tp_size)          # the KV budget is each rank's, for its KV heads
    return LLMEngine(model_dir, dtype="float32", kernel_backend=kernel_backend, tensor_parallel_size=tp_size,
                     max_loras=2, max_num_seqs=4, max_num_batched_tokens=24, enable_kv_cache_reuse=True,
                     kv_cache_memory_bytes=kv_bytes_for_blocks(6, 16, cfg))


@pytest.fixture(scope="module")
def expected(tiny_model_dir, tiny_adapters):
    """TP=1's answers (TP=1 equals PEFT: test_lora_peft.py, test_device.py)."""
    return {backend: run_scenario(scenario_engine(tiny_model_dir, 1, backend), tiny_adapters)
            for backend in ("torch", "cpu") if backend == "torch" or cpu_kernels_build()}


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_answers_equal_one_rank(tiny_model_dir, tiny_adapters, tiny_peft, expected, tp_size,
                                                kernel_backend):
    engine = scenario_engine(tiny_model_dir, tp_size, kernel_backend)
    try:
        tokens, logits = run_scenario(engine, tiny_adapters)
        assert engine.scheduler.num_preemptions > 0 and engine.lora_cache.stats.device_evictions > 0
        assert engine.blocks.num_hits > 0 and engine.blocks.num_used_blocks == 0
    finally:
        engine.close()
    want_tokens, want_logits = expected[kernel_backend]
    assert tokens == want_tokens
    assert len(tokens[(1, 1)]) == 12 and len(tokens[(ABORTED, 0)]) == 2
    prompts = scenario_prompts(engine.model_config.vocab_size)
    for i in GREEDY:                                  # and each greedy request is PEFT's, not only TP=1's
        adapter = "__base__" if TASKS[i] is None else f"a{TASKS[i] - 1}"
        want = peft_greedy(tiny_peft, prompts[i], adapter, 12)   # stops at eos; the engine ran on (end_id None)
        assert tokens[(i, 0)][:len(want)] == want, (i, adapter)
    assert logits.keys() == want_logits.keys() and logits
    for key, got in logits.items():
        torch.testing.assert_close(torch.stack(got), torch.stack(want_logits[key]), atol=LOGITS_ATOL, rtol=0)


def test_a_fused_qkv_adapter_at_two_ranks_equals_hf_with_its_deltas_merged(tiny_model_dir):
    """A hand-built TensorRT-LLM adapter with a fused attn_qkv module (and gate, down, up), split over two ranks: its
    greedy tokens are those of HF with the adapter's deltas merged into the weights (no code of ours in the oracle)."""
    from transformers import AutoModelForCausalLM
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", tensor_parallel_size=2,
                       kv_cache_memory_bytes=1 << 20)
    try:
        weights, config, deltas = hand_built_adapter(engine.model_config)
        engine.add_lora(5, weights, config)
        prompts = random_prompts([6, 21, 13], engine.model_config.vocab_size, seed=17)
        outputs = engine.generate(prompts, max_new_tokens=10, lora_task_ids=[5, None, 5])
    finally:
        engine.close()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        params = dict(merged.named_parameters())
        for name, delta in deltas.items():
            params[name] += delta
    for prompt, task, out in zip(prompts, [5, None, 5], outputs):
        assert out == hf_greedy(merged if task else base, prompt, 10)
    assert outputs[0] != hf_greedy(base, prompts[0], 10)                     # the adapter changes tokens


@INTERPRETER_MARK
def test_decode_graphs_on_every_rank_answer_the_eager_tokens(tiny_model_dir, tiny_adapters):
    """Decode steps through each rank's graphs (on CPU their padded fixed-buffer steps run without capture, through
    the Triton kernels in the interpreter), the all-reduces inside them: TP=2 answers TP=1's eager tokens."""
    prompts = random_prompts([7, 21, 12, 3, 30], 512, seed=52)
    answers = []
    for tp_size in (1, 2):
        engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="triton", tensor_parallel_size=tp_size,
                           kv_cache_memory_bytes=1 << 20, max_num_seqs=6)
        try:
            for task_id, path in enumerate(tiny_adapters[:2], start=1):
                engine.add_lora_dir(task_id, path)
            if tp_size > 1:
                engine.runner.start_graphs(engine.lora_cache, capture=False)
                replays = []
                run_graph = engine.runner.graphs.run
                engine.runner.graphs.run = lambda bucket, *args: replays.append(bucket) or run_graph(bucket, *args)
            answers.append(engine.generate(prompts, max_new_tokens=6, lora_task_ids=[1, None, 2, 1, None]))
        finally:
            engine.close()
    assert answers[1] == answers[0] and len(replays) >= 5


def test_int8_shares_are_slices_of_one_ranks_int8_weights(tiny_model_dir):
    """Column-parallel projections' rows and row-parallel ones' columns, each rank's int8 values and scales those of
    one rank's weights (a row-parallel weight quantized whole before its columns are sliced)."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    whole = load_weights(tiny_model_dir, cfg, torch.float32, weight_dtype="int8")
    shares = [load_weights(tiny_model_dir, cfg, torch.float32, tp_size=2, tp_rank=rank, weight_dtype="int8")
              for rank in range(2)]
    for name in ("layers.1.o_proj", "layers.1.down_proj"):
        assert all(torch.equal(share[name].scale, whole[name].scale) for share in shares)
        assert torch.equal(torch.cat([share[name].data for share in shares], dim=1), whole[name].data)
    gate_up = torch.cat([share["layers.1.gate_up_proj"].scale for share in shares]).view(2, 2, -1)
    assert torch.equal(gate_up.transpose(0, 1).flatten(), whole["layers.1.gate_up_proj"].scale)  # (gate, then up)


def answers_at_one_and_two_ranks(model_dir, adapter_dirs, prompts, check=lambda engine: None, **kwargs):
    """Greedy answers to the prompts (the base model and two adapters, mixed) at one rank and at two; check(engine)
    before each."""
    answers = []
    for tp_size in (1, 2):
        engine = LLMEngine(model_dir, tensor_parallel_size=tp_size, kv_cache_memory_bytes=1 << 20, **kwargs)
        try:
            check(engine)
            for task_id, path in enumerate(adapter_dirs[:2], start=1):
                engine.add_lora_dir(task_id, path)
            answers.append(engine.generate(prompts, max_new_tokens=8, lora_task_ids=[1, None, 2, 1, None]))
        finally:
            engine.close()
    return answers


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_int8_weights_at_two_ranks_answer_one_ranks_tokens(tiny_model_dir, tiny_adapters, kernel_backend):
    """weight_dtype int8 over two ranks: the base model and a mixed batch of adapters, greedy, TP=1's tokens."""
    one, two = answers_at_one_and_two_ranks(tiny_model_dir, tiny_adapters, random_prompts([7, 21, 12, 3, 30], 512, 57),
                                            dtype="float32", kernel_backend=kernel_backend, weight_dtype="int8")
    assert two == one


@pytest.mark.skipif(not cpu_kernels_build(), reason="the compiled CPU kernels do not build here")
def test_bf16_weights_beside_fp32_at_two_ranks_answer_one_ranks_tokens(tiny_model_dir, tiny_adapters, monkeypatch):
    """dtype auto on a CPU without bf16 arithmetic (backend.device.projection_dtype): every rank serves its
    projections and its KV cache in bf16 beside fp32 activations, and two ranks answer one rank's tokens."""
    monkeypatch.setattr(device_module, "cpu_has_native_bf16", lambda: False)

    def served_in_bf16(engine):
        workers = engine.runner.tp.workers if engine.runner.tp else []
        assert engine.runner.projection_dtype == engine.runner.kv_caches[0][0].dtype == torch.bfloat16
        assert all("--projection_dtype=bfloat16" in worker.args for worker in workers)
    one, two = answers_at_one_and_two_ranks(tiny_model_dir, tiny_adapters, random_prompts([7, 21, 12, 3, 30], 512, 59),
                                            served_in_bf16, kernel_backend="cpu")
    assert two == one


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """The tiny Llama 4x wider (hidden 256, intermediate 512): at two ranks each row-parallel share holds whole INT4
    groups of 128."""
    path = tmp_path_factory.mktemp("wide-llama")
    build_tiny(path, seed=4, architecture="llama", hidden_size=256, intermediate_size=512)
    return path


def test_int4_shares_are_slices_of_one_ranks_int4_weights(wide_model_dir):
    """Row-parallel projections' columns whole groups of one rank's weights (values, scales, zero points);
    column-parallel ones' rows with their groups' scales."""
    cfg = ModelConfig.from_dir(wide_model_dir)
    whole = load_weights(wide_model_dir, cfg, torch.float32, weight_dtype="int4")
    shares = [load_weights(wide_model_dir, cfg, torch.float32, tp_size=2, tp_rank=rank, weight_dtype="int4")
              for rank in range(2)]
    for name in ("layers.1.o_proj", "layers.1.down_proj"):
        assert all(share[name].group_size == whole[name].group_size == 128 for share in shares)
        assert torch.equal(torch.cat([share[name].data for share in shares], dim=1), whole[name].data)
        for part in ("scale", "zero"):
            assert torch.equal(torch.cat([getattr(share[name], part) for share in shares]), getattr(whole[name], part))
    gate_up = torch.cat([share["layers.1.gate_up_proj"].scale for share in shares], dim=1).view(2, 2, 2, -1)
    assert torch.equal(gate_up.transpose(1, 2).flatten(1), whole["layers.1.gate_up_proj"].scale)  # (gate, then up)


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
@pytest.mark.parametrize("weight_dtype", ["int4", "fp8"])
def test_grouped_weights_at_two_ranks_answer_one_ranks_tokens(wide_model_dir, kernel_backend, weight_dtype):
    """INT4's shares of whole groups, FP8's of rows with one scale each."""
    prompts = random_prompts([7, 21, 12, 3, 30], 512, seed=58)
    answers = []
    for tp_size in (1, 2):
        engine = LLMEngine(wide_model_dir, dtype="float32", kernel_backend=kernel_backend, weight_dtype=weight_dtype,
                           tensor_parallel_size=tp_size, kv_cache_memory_bytes=1 << 20)
        try:
            answers.append(engine.generate(prompts, max_new_tokens=8))
        finally:
            engine.close()
    assert answers[1] == answers[0]


def test_int4_shares_too_narrow_for_a_group_are_refused_by_name(tiny_model_dir):
    """The tiny model's o_proj reads 64 inputs, one group a row: two ranks hold 32 of each row on its scale, four
    would hold 16, narrower than any group."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    halves = [load_weights(tiny_model_dir, cfg, torch.float32, tp_size=2, tp_rank=rank, weight_dtype="int4")
              for rank in range(2)]
    assert [half["layers.0.o_proj"].group_size for half in halves] == [32, 32]
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.o_proj.weight at tp_size 4: INT4 groups of 16 "
                                         r"input channels over 16"):
        load_weights(tiny_model_dir, cfg, torch.float32, tp_size=4, tp_rank=0, weight_dtype="int4")


def test_the_workers_end_with_the_engine(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", tensor_parallel_size=2,
                       kv_cache_memory_bytes=1 << 20)
    workers = list(engine.runner.tp.workers)
    engine.close()
    assert all(w.poll() is not None for w in workers)


def test_an_engine_that_fails_to_start_leaves_no_workers_or_process_group(tiny_model_dir, monkeypatch):
    """A start that fails once the workers run (here the KV cache) stops them and leaves the group, so that the
    process can start an engine again (it could not: 'the default process group' was initialized twice)."""
    started = []
    real_init = TensorParallelGroup.__init__

    def recorded_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        started.extend(self.workers)

    def failing_allocation(self):
        raise RuntimeError("no memory for the KV cache")

    monkeypatch.setattr(TensorParallelGroup, "__init__", recorded_init)
    with monkeypatch.context() as patched:
        patched.setattr(ModelRunner, "allocate_kv_cache", failing_allocation)
        with pytest.raises(RuntimeError, match="no memory for the KV cache"):
            LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", tensor_parallel_size=2)
    assert started and all(w.poll() is not None for w in started) and not dist.is_initialized()
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", tensor_parallel_size=2,
                       kv_cache_memory_bytes=1 << 20)
    engine.close()


def test_a_group_whose_worker_never_joins_leaves_the_next_one_able_to_start(tiny_model_dir, monkeypatch):
    """A worker too slow to join (here: one that never starts) fails the start within its timeout, and a later
    start in the same process joins its workers (torch's count of groups made no longer names the next one apart
    from theirs: every later start waited 60 s and failed)."""
    import backend.model.parallel as parallel
    with monkeypatch.context() as patched:
        patched.setattr(parallel, "python_executable", lambda: "/bin/true")
        with pytest.raises(dist.DistStoreError):
            LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", tensor_parallel_size=2,
                      kv_cache_memory_bytes=1 << 20, tensor_parallel_timeout_s=1)
    assert not dist.is_initialized()
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", tensor_parallel_size=2,
                       kv_cache_memory_bytes=1 << 20)
    assert engine.generate([[5, 6, 7]], max_new_tokens=3)
    engine.close()


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_lost_worker_fails_every_stream_and_breaks_the_engine(tiny_model_dir, fault):
    """A worker killed (the collective fails) or stopped (it outlasts tensor_parallel_timeout_s) mid-stream: each
    open stream, and each later one, gets an error as its final answer, and the loop reports the engine dead."""
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", tensor_parallel_size=2,
                       kv_cache_memory_bytes=1 << 20, tensor_parallel_timeout_s=3)
    loop = EngineLoop(engine)
    worker = engine.runner.tp.workers[0]
    try:
        streams = [FakeStream(p, max_new_tokens=400) for p in prompts(engine, 3)]
        for stream in streams:
            loop.submit(stream)
        while not any(stream.tokens for stream in streams):
            time.sleep(0.01)
        os.kill(worker.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        for stream in streams:
            assert stream.wait().answers == [stream.answers[0]] and "tensor parallel" in stream.answers[0]
        assert not loop.alive
        late = FakeStream(prompts(engine, 1)[0])
        loop.submit(late)
        assert late.wait().answers[0].startswith("fail: engine unavailable")
    finally:
        worker.kill()                                           # a stopped one, not yet gone
        loop.stop()
        engine.close()


@pytest.mark.parametrize(("tp_size", "message"), [
    (3, "tensor_parallel_size 3 does not divide the model's num_attention_heads 4"),
    (8, "tensor_parallel_size 8 does not divide the model's num_attention_heads 4")])
def test_a_size_the_model_does_not_split_into_is_refused(tiny_model_dir, tp_size, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(tiny_model_dir, dtype="float32", tensor_parallel_size=tp_size)


def test_guided_decoding_on_smollm2_at_three_ranks(smollm2_dir):
    """SmolLM2-135M (9 heads, 3 KV heads) at TP=3: a JSON schema's output equals TP=1's."""
    from tests.backend.guided.test_guided import PROMPT, SCHEMA
    tokenizer = load_tokenizer(str(smollm2_dir))
    ids = tokenizer(PROMPT)["input_ids"]
    outputs = []
    for tp_size in (1, 3):
        engine = LLMEngine(smollm2_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, tensor_parallel_size=tp_size,
                           guided_decoding_backend="xgrammar", max_num_batched_tokens=64)
        try:
            outputs.append(engine.generate([ids], max_new_tokens=40, guide_type="json_schema",
                                           guide=json.dumps(SCHEMA), end_id=tokenizer.eos_token_id)[0])
        finally:
            engine.close()
    assert outputs[0] == outputs[1]
    json.loads(tokenizer.decode(outputs[1], skip_special_tokens=True))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensor_parallel_on_cuda_with_nccl(tiny_model_dir, tiny_adapters):
    """The scenario at TP=2 over NCCL (cuda:0, cuda:1) with the Triton kernels equals TP=1 on cuda:0."""
    answers = []
    for tp_size in (1, 2):
        cfg = ModelConfig.from_dir(tiny_model_dir).shard(tp_size)
        engine = LLMEngine(tiny_model_dir, dtype="float32", device="cuda:0", kernel_backend="triton",
                           tensor_parallel_size=tp_size, max_loras=2, max_num_seqs=4, max_num_batched_tokens=24,
                           enable_kv_cache_reuse=True, kv_cache_memory_bytes=kv_bytes_for_blocks(6, 16, cfg))
        try:
            answers.append(run_scenario(engine, tiny_adapters))
        finally:
            engine.close()
    assert answers[0][0] == answers[1][0]
    for key, got in answers[1][1].items():
        torch.testing.assert_close(torch.stack(got), torch.stack(answers[0][1][key]), atol=LOGITS_ATOL, rtol=0)

"""The engine on a device: placement, KV sizing, the pinned host tier, and greedy equality with transformers + PEFT
on every device there is (CUDA cases skip with "needs CUDA" where there is none)."""
import gc

import pytest
import torch

from backend import LLMEngine
from backend import device as device_module
from backend.config import EngineConfig
from backend.device import STAGING_RING, StepStaging, aligned_offsets, resolve_dtype
from tests.helpers import (CUDA_MARKS, DEVICES, INTERPRETER_MARK, cpu_kernels_build, kv_bytes_for_blocks, needs_cuda,
                           peft_greedy, peft_model_with, random_prompts, with_kv_rounded,
                           with_projections_rounded)

PROMPT_LENGTHS = [9, 30, 4, 17, 23, 12]


def engine_on(model_dir, device: str, **kwargs) -> LLMEngine:
    kwargs = {"dtype": "float32", "kv_cache_memory_bytes": 1 << 20} | kwargs
    return LLMEngine(model_dir, device=device, **kwargs)


def test_device_names_are_checked():
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EngineConfig(model_dir="m", device="gpu")
    with pytest.raises(ValueError, match="kv_cache_free_gpu_mem_fraction"):
        EngineConfig(model_dir="m", kv_cache_free_gpu_mem_fraction=1.5)


@pytest.mark.parametrize(("capability", "dtype"), [((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                                   ((9, 0), torch.bfloat16)])
def test_dtype_auto_on_cuda_follows_the_compute_capability(monkeypatch, capability, dtype):
    """bf16 tl.dot needs sm_80: a T4 (sm_75) serves fp16."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == dtype


def test_dtype_auto_on_a_cpu_whose_aten_runs_at_avx2_is_fp32(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 (or a CPU without avx512_bf16 and AMX): no bf16 arithmetic to use."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("kernel_backend", [pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_kernels_build(), reason="the compiled CPU kernels do not build here")), "torch"])
def test_dtype_auto_without_bf16_arithmetic_serves_bf16_weights_and_cache(monkeypatch, tiny_model_dir, tiny_adapters,
                                                                          kernel_backend):
    """On a CPU without bf16 arithmetic dtype auto computes in fp32, and with the compiled kernels serves the
    projections, the LM head and the KV cache in bf16 (what auto serves everywhere else; half the bytes a decode step
    reads, twice the tokens a cache holds), widened as the GEMMs and attention load them: greedy tokens, adapters
    mixed, == fp32 PEFT over the model whose projection and LM head weights are rounded to bf16 and whose attention
    sees K and V rounded to bf16 (without that rounding some token differs: the check can tell). The torch reference
    keeps them in fp32."""
    monkeypatch.setattr(device_module, "cpu_has_native_bf16", lambda: False)
    engine = LLMEngine(tiny_model_dir, device="cpu", kernel_backend=kernel_backend, kv_cache_memory_bytes=1 << 20,
                       max_num_batched_tokens=32)
    served = torch.bfloat16 if kernel_backend == "cpu" else torch.float32
    weights = engine.runner.model.w
    assert engine.runner.dtype == torch.float32 and engine.runner.projection_dtype == served
    assert {w.dtype for name, w in weights.items() if name.endswith("_proj") or name == "lm_head"} == {served}
    assert weights["embed_tokens"].dtype == torch.float32
    assert engine.runner.kv_cache_dtype == served and engine.runner.kv_caches[0][0].dtype == served
    for task_id, path in enumerate(tiny_adapters, start=1):
        engine.add_lora_dir(task_id, path)
    prompts = random_prompts(PROMPT_LENGTHS, engine.model_config.vocab_size, seed=11)
    tasks = [1, None, 2, 3, 4, 2]
    outputs = engine.generate(prompts, max_new_tokens=8, lora_task_ids=tasks)
    peft = with_projections_rounded(peft_model_with(tiny_model_dir, tiny_adapters), served)
    names = ["__base__" if t is None else f"a{t - 1}" for t in tasks]
    if served == torch.bfloat16:
        assert outputs != [peft_greedy(peft, p, name, 8) for p, name in zip(prompts, names)]
        peft = with_kv_rounded(peft, served)
    assert outputs == [peft_greedy(peft, p, name, 8) for p, name in zip(prompts, names)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_asking_for_cuda_without_one_is_a_clear_error(tiny_model_dir):
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        engine_on(tiny_model_dir, "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_weights_cache_slots_and_host_tier_live_where_they_should(tiny_model_dir, tiny_adapters, device):
    engine = engine_on(tiny_model_dir, device)
    engine.add_lora_dir(1, tiny_adapters[0])
    runner, slots = engine.runner, engine.lora_cache.slots
    device_tensors = [*runner.model.w.values(), runner.model.cos_sin, slots.ranks,
                      *(t for layer in runner.kv_caches for t in layer),
                      *(t for layer in slots.a + slots.b for t in layer.values())]
    assert {t.device.type for t in device_tensors} == {device}
    from kernels import cpu_ext
    want = "triton" if device == "cuda" else "cpu" if cpu_ext.available() else "torch"
    assert runner.ops.name == want                                               # kernel_backend auto
    a, b = next(iter(engine.lora_cache.host[1].weights.values()))
    assert a.device.type == b.device.type == "cpu"
    assert a.is_pinned() == b.is_pinned() == (device == "cuda")               # page-locked for async uploads
    if device == "cuda":                                     # one pinned buffer, made by parse (off the loop)
        storages = {t.untyped_storage().data_ptr() for pair in engine.lora_cache.host[1].weights.values()
                    for t in pair}
        assert len(storages) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_with_mixed_adapters_matches_peft(tiny_model_dir, tiny_adapters, device):
    engine = engine_on(tiny_model_dir, device, max_num_batched_tokens=32)
    for task_id, path in enumerate(tiny_adapters, start=1):
        engine.add_lora_dir(task_id, path)
    prompts = random_prompts(PROMPT_LENGTHS, engine.model_config.vocab_size, seed=11)
    tasks = [1, None, 2, 3, 4, 2]
    outputs = engine.generate(prompts, max_new_tokens=8, lora_task_ids=tasks)
    peft = peft_model_with(tiny_model_dir, tiny_adapters).to(device)
    names = ["__base__" if t is None else f"a{t - 1}" for t in tasks]
    assert outputs == [peft_greedy(peft, p, name, 8) for p, name in zip(prompts, names)]


@pytest.mark.parametrize("device", DEVICES)
def test_adapters_churn_through_fewer_slots_than_adapters(tiny_model_dir, tiny_adapters, device):
    """Four adapters (ranks 4-64) through two device slots, requests arriving while others run, a KV pool small
    enough to preempt, one LoRA request aborted mid-run: evictions, reloads into slots a larger rank used,
    prefetches, and every finished output still equals PEFT's; no pin is left behind."""
    cfg = engine_on(tiny_model_dir, device).model_config
    engine = engine_on(tiny_model_dir, device, max_loras=2, max_num_seqs=3, max_num_batched_tokens=24,
                       kv_block_size=16, kv_cache_memory_bytes=kv_bytes_for_blocks(4, 16, cfg))
    for task_id, path in enumerate(tiny_adapters, start=1):
        engine.add_lora_dir(task_id, path)
    prompts = random_prompts(PROMPT_LENGTHS + [14, 6], engine.model_config.vocab_size, seed=12)
    tasks = [1, 2, 3, 4, 1, 3, 2, 4]
    aborted = 5
    outputs = {i: [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    while pending or engine.has_unfinished:
        if pending:
            i = pending.pop(0)
            engine.add_request(prompts[i], request_id=i, lora=tasks[i], max_new_tokens=16)
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.request_id == aborted and len(outputs[aborted]) == 2:
                assert engine.abort(aborted)
    stats = engine.lora_cache.stats
    assert stats.device_evictions > 0 and engine.scheduler.num_preemptions > 0
    assert sum(engine.lora_cache.pins) == stats.device_pins == 0 and engine.blocks.num_used_blocks == 0
    peft = peft_model_with(tiny_model_dir, tiny_adapters).to(device)
    for i, prompt in enumerate(prompts):
        want = peft_greedy(peft, prompt, f"a{tasks[i] - 1}", 16)
        assert outputs[i] == (want[:2] if i == aborted else want), f"request {i} (task {tasks[i]})"


def first_token_logits(engine: LLMEngine, prompts: list[list[int]], tasks: list[int | None]) -> torch.Tensor:
    """[rows, vocab] fp32: the logits each request's first token was sampled from."""
    ids = [engine.add_request(p, lora=t, max_new_tokens=1, return_generation_logits=True)
           for p, t in zip(prompts, tasks)]
    logits = {}
    while any(request_id in engine.seqs for request_id in ids):
        for out in engine.step():
            if out.generation_logits is not None:
                logits[out.request_id] = out.generation_logits.float().cpu()
    return torch.stack([logits[request_id] for request_id in ids])


def peft_first_token_logits(model, prompts: list[list[int]], tasks: list[int | None]) -> torch.Tensor:
    rows = []
    with torch.inference_mode():
        for prompt, task in zip(prompts, tasks):
            ids = torch.tensor([prompt], device=model.device)
            out = model(input_ids=ids, adapter_names=["__base__" if task is None else f"a{task - 1}"])
            rows.append(out.logits[0, -1].float().cpu())
    return torch.stack(rows)


def distance(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row, the largest |got - want| / (1 + |want|) over the vocabulary."""
    return ((got - want).abs() / (1 + want.abs())).amax(dim=-1)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_is_as_close_to_fp32_peft_as_bf16_peft_is(tiny_model_dir, tiny_adapters, device):
    """bf16 rounding alone flips the first token of near-tied rows of this random tiny model (bf16 PEFT differs from
    fp32 PEFT in 2 of these 6 rows on a CPU, and the engine on an H200 from bf16 PEFT in one), so bf16 PEFT is no
    oracle for bf16 tokens. fp32 PEFT is, with bf16 PEFT's own distance from it as the yardstick: the engine's
    first-token logits in bf16 stay within 4x that distance of fp32 PEFT's (on a CPU: 2.4x at most; a dropped
    adapter is 50-100x), and its greedy token differs from fp32 PEFT's only where fp32 PEFT's two candidates are
    within it."""
    engine = engine_on(tiny_model_dir, device, dtype="bfloat16")
    for task_id, path in enumerate(tiny_adapters[:2], start=1):
        engine.add_lora_dir(task_id, path)
    prompts = random_prompts(PROMPT_LENGTHS, engine.model_config.vocab_size, seed=13)
    tasks = [1, None, 2, 1, 2, None]
    got = first_token_logits(engine, prompts, tasks)
    want = peft_first_token_logits(peft_model_with(tiny_model_dir, tiny_adapters[:2]).to(device), prompts, tasks)
    bf16_peft = peft_first_token_logits(peft_model_with(tiny_model_dir, tiny_adapters[:2], dtype=torch.bfloat16)
                                        .to(device), prompts, tasks)
    yardstick = distance(bf16_peft, want)
    assert (distance(got, want) <= 4 * yardstick).all(), (distance(got, want), yardstick)
    for row, (token, best) in enumerate(zip(got.argmax(-1), want.argmax(-1))):
        margin = (want[row, best] - want[row, token]) / (1 + want[row, best].abs())
        assert margin <= 2 * yardstick[row], (row, margin, yardstick[row])


@needs_cuda
def test_a_step_syncs_only_for_its_one_result_copy(tiny_model_dir, tiny_adapters):
    """Under torch.cuda.set_sync_debug_mode("error") any hidden sync (.item(), .tolist(), a blocking copy)
    raises; the steps below prefill and decode with adapters, every sampling option and log probs."""
    engine = engine_on(tiny_model_dir, "cuda", max_loras=2)
    engine.add_lora_dir(1, tiny_adapters[0])
    engine.add_lora_dir(2, tiny_adapters[1])
    prompts = random_prompts([12, 5, 20, 8], engine.model_config.vocab_size, seed=14)
    options = [dict(temperature=0.8, top_k=5, seed=1, return_log_probs=True),
               dict(temperature=1.2, top_p=0.7, repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1),
               dict(bad_words=[[7], [3, 9]], end_id=2, min_tokens=3),
               dict(return_log_probs=True)]
    for prompt, task, option in zip(prompts, [1, 2, None, 1], options):
        engine.add_request(prompt, lora=task, max_new_tokens=6, **option)
    engine.step()                                   # first launches compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished:
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@needs_cuda
def test_kv_cache_takes_its_share_of_free_gpu_memory(tiny_model_dir):
    gc.collect()
    torch.cuda.empty_cache()                 # the engine frees what earlier tests left cached before it measures
    free_before, total = torch.cuda.mem_get_info()
    engine = LLMEngine(tiny_model_dir, device="cuda", dtype="float32", kv_cache_free_gpu_mem_fraction=0.05)
    cache_bytes = sum(t.nbytes for layer in engine.runner.kv_caches for t in layer)
    assert 0 < cache_bytes <= 0.05 * free_before
    assert engine.blocks.num_blocks == engine.runner.num_blocks > 0
    assert engine.generate([[5, 6, 7]], max_new_tokens=2)


@pytest.mark.parametrize("kernel_backend,device", [
    ("torch", "cpu"), ("cpu", "cpu"), pytest.param("torch", "cuda", marks=CUDA_MARKS),
    pytest.param("triton", "cpu", marks=INTERPRETER_MARK), pytest.param("triton", "cuda", marks=CUDA_MARKS)])
def test_a_cache_full_of_nan_before_the_run_changes_no_token(tiny_model_dir, kernel_backend, device):
    """Positions past each sequence's length and unused block-table entries are never read into a result: stale
    values (here NaN) left by other requests cannot leak into this one."""
    engine = engine_on(tiny_model_dir, device, kernel_backend=kernel_backend, kv_block_size=16,
                       max_num_batched_tokens=32)
    prompts = random_prompts([3, 37, 18, 9], engine.model_config.vocab_size, seed=15)
    clean = engine.generate(prompts, max_new_tokens=5)
    for k_cache, v_cache in engine.runner.kv_caches:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    assert engine.generate(prompts, max_new_tokens=5) == clean


def test_an_adversarial_adapter_changes_no_other_requests_tokens(tiny_model_dir):
    """An adapter of absurd (finite) weights drives its own activations to inf/NaN and its KV blocks with them;
    the unrelated requests beside it, before and after, get exactly the tokens of a run without it. Adapters kept
    in fp32 here: 1e19 is beyond fp16, where such weights are refused at the upload."""
    from tests.backend.lora.test_lora_cache import make_adapter
    engine = engine_on(tiny_model_dir, "cpu", kv_block_size=16, max_num_batched_tokens=40, lora_dtype="float32")
    weights, config = make_adapter(engine.model_config, 4, 0, modules=(1, 2, 3, 4, 5, 6, 7))
    engine.add_lora(66, weights * 1e19, config)
    engine.add_lora(7, weights, config)
    prompts = random_prompts([9, 33, 5, 20, 14], engine.model_config.vocab_size, seed=17)
    clean = engine.generate(prompts, max_new_tokens=8, lora_task_ids=[None, 7, None, 7, None])
    mixed = engine.generate(prompts + prompts[:2], max_new_tokens=8, lora_task_ids=[None, 7, None, 7, None, 66, 66])
    assert mixed[:5] == clean
    assert any(not torch.isfinite(k).all() for k, _ in engine.runner.kv_caches), "its blocks hold inf/NaN now"
    assert engine.generate(prompts, max_new_tokens=8, lora_task_ids=[None, 7, None, 7, None]) == clean


def test_step_inputs_are_packed_at_16_byte_offsets():
    """Triton specializes pointer arguments on 16-byte alignment: views at 4-byte offsets (a 9-token prompt's
    positions after its 9 token ids) would compile new kernel variants mid-serving."""
    offsets, total = aligned_offsets([9, 9, 2, 1, 3, 0, 4])
    assert offsets == [0, 12, 24, 28, 32, 36, 36] and total == 40


def test_a_lone_int32_tensor_is_staged_in_a_ring_of_buffers_taken_in_turn():
    """A steady step's buffer is copied into the next of STAGING_RING host buffers (no allocation a step); a
    buffer grows where a step sends more, and each staged copy holds exactly what was sent."""
    staging = StepStaging(torch.device("cpu"))
    staged = []
    for size in (40, 40, 40, 40, 100, 40):
        sent = torch.arange(size, dtype=torch.int32) * (len(staged) + 1)
        host, offsets = staging.pack({"kept": sent})
        assert offsets == [0] and torch.equal(host, sent) and not host.is_pinned()
        staged.append(host.data_ptr())
    assert len(staging.ring) == STAGING_RING == 3
    assert staged[3] == staged[0] and len(set(staged[:3])) == 3          # in turn; the fifth grew its buffer
    assert staged[4] != staged[1] and staged[5] == staged[2]


@needs_cuda
def test_a_staging_buffer_is_not_written_while_a_copy_may_still_read_it():
    """With the stream held up by a long kernel, five steady uploads in a row each land with their own values, as
    the work queued after each reads them: the ring's host buffers are still to be read, so the fourth and fifth go
    through fresh pinned buffers; the first three land in one device buffer, each read before the next lands."""
    staging = StepStaging(torch.device("cuda"))
    torch.cuda._sleep(200_000_000)                    # ~0.1 s of GPU time queued before the copies
    sent = [torch.full((1000,), i, dtype=torch.int32) for i in range(5)]
    landed = []
    for t in sent:
        moved = staging.upload({"kept": t})["kept"]
        landed.append((moved.data_ptr(), moved.clone()))        # a step's reading, in stream order
    assert all(read.tolist() == t.tolist() for (_, read), t in zip(landed, sent))
    assert len(staging.ring) == STAGING_RING and len({ptr for ptr, _ in landed[:3]}) == 1


@needs_cuda
def test_every_uploaded_view_is_16_byte_aligned():
    staging = StepStaging(torch.device("cuda"))
    views = staging.upload({"input_ids": torch.arange(9), "positions": torch.arange(9), "query_starts":
                            torch.tensor([0, 9]), "scale": torch.ones(3), "mask": torch.ones(5, dtype=torch.bool)})
    assert all(view.data_ptr() % 16 == 0 for view in views.values())
    assert views["positions"].tolist() == list(range(9)) and views["scale"].tolist() == [1.0] * 3

"""Many adapters in one batch equal Hugging Face PEFT token for token, however the adapters arrive."""
import numpy as np
import pytest
import torch

from backend import LLMEngine, LoraRequest
from backend.lora.peft import load_lora_dir, peft_to_trtllm
from tests.helpers import CPU_BACKENDS, make_peft_adapters, peft_greedy, peft_model_with, random_prompts

MAX_NEW = 10
# request i uses adapter TASKS[i] (None: base only); several requests share an adapter
TASKS = [1, 2, None, 3, 4, 1, None, 4, 2, 3]
LENGTHS = [5, 21, 9, 14, 33, 3, 17, 26, 11, 8]


@pytest.fixture(scope="module")
def tiny_peft(tiny_model_dir, tiny_adapters):
    return peft_model_with(tiny_model_dir, tiny_adapters)


@pytest.fixture(scope="module")
def tiny_expected(tiny_model_dir, tiny_peft):
    prompts = random_prompts(LENGTHS, 512, seed=21)
    expected = [peft_greedy(tiny_peft, p, "__base__" if t is None else f"a{t - 1}", MAX_NEW)
                for p, t in zip(prompts, TASKS)]
    return prompts, expected


def run_mixed(engine: LLMEngine, prompts, end_id) -> list[list[int]]:
    """Half the requests at t=0, the rest joining one per step while the first ones decode."""
    outputs = {i: [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    for i in pending[:len(prompts) // 2]:
        engine.add_request(prompts[i], request_id=i, lora=TASKS[i], max_new_tokens=MAX_NEW, end_id=end_id)
    pending = pending[len(prompts) // 2:]
    while pending or engine.has_unfinished:
        if pending:
            i = pending.pop(0)
            engine.add_request(prompts[i], request_id=i, lora=TASKS[i], max_new_tokens=MAX_NEW, end_id=end_id)
        for out in engine.step():
            assert out.error is None
            outputs[out.request_id] += out.new_token_ids
    return [outputs[i] for i in range(len(prompts))]


def test_adapters_change_the_output(tiny_expected):
    _, expected = tiny_expected
    base = [e for e, t in zip(expected, TASKS) if t is None]
    assert len({tuple(e) for e in expected}) == len(expected) and base


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_mixed_batch_from_peft_dirs_matches_peft(tiny_model_dir, tiny_adapters, tiny_expected, kernel_backend):
    prompts, expected = tiny_expected
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend=kernel_backend, kv_cache_memory_bytes=1 << 20,
                       max_num_batched_tokens=24)
    for task_id, path in enumerate(tiny_adapters, start=1):
        engine.add_lora_dir(task_id, path)
    assert run_mixed(engine, prompts, end_id=2) == expected


@pytest.mark.parametrize("storage", ["float16", "float32"])
def test_trtllm_tensors_with_shuffled_rows_match_peft(tiny_model_dir, tiny_adapters, tiny_expected, storage):
    prompts, expected = tiny_expected
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    rng = np.random.default_rng(0)
    tensors = {}
    for task_id, path in enumerate(tiny_adapters, start=1):
        weights, config = peft_to_trtllm(path, "float32")
        order = rng.permutation(len(config))
        tensors[task_id] = (weights[order].astype(storage)[None], config[order][None])   # [1, N, R], [1, N, 3]
    outputs = {}
    for i, (prompt, task) in enumerate(zip(prompts, TASKS)):
        first = task is not None and task not in {TASKS[j] for j in range(i)}
        w, c = tensors[task] if first else (None, None)          # weights with the first request only
        engine.add_request(prompt, request_id=i, lora=LoraRequest.of(task, w, c), max_new_tokens=MAX_NEW, end_id=2)
        outputs[i] = []
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    got = [outputs[i] for i in range(len(prompts))]
    if storage == "float32":
        assert got == expected
    else:                                                        # fp16 rounding of the weights only
        assert sum(g == e for g, e in zip(got, expected)) >= len(expected) - 1


def test_trtllm_dir_round_trip_through_the_converter(tiny_model_dir, tiny_adapters, tmp_path, tiny_expected):
    import subprocess
    import sys
    from tests.helpers import ROOT
    out = tmp_path / "trtllm"
    subprocess.run([sys.executable, ROOT / "scripts" / "hf_lora_convert.py", "-i", tiny_adapters[3], "-o", out,
                    "--storage-type", "float32"], check=True, capture_output=True)
    weights, config = load_lora_dir(out)
    assert weights.shape[0] == 1 and config.shape == (1, 14, 3)             # 7 modules x 2 layers
    assert sorted(config[0, :, 2].tolist()) == [12, 12] + [64] * 12         # rank_pattern for down_proj
    prompts, expected = tiny_expected
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    engine.add_lora_dir(4, out)
    idx = [i for i, t in enumerate(TASKS) if t == 4]
    assert engine.generate([prompts[i] for i in idx], max_new_tokens=MAX_NEW, lora_task_ids=[4] * len(idx),
                           end_id=2) == [expected[i] for i in idx]


def test_prefetch_dir_is_loaded_at_start(tiny_model_dir, tiny_adapters, tmp_path, tiny_expected):
    import shutil
    for task_id, path in ((7, tiny_adapters[0]), (9, tiny_adapters[2])):
        shutil.copytree(path, tmp_path / str(task_id))
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20,
                       lora_prefetch_dir=str(tmp_path))
    assert engine.lora_cache.contains(7) and engine.lora_cache.contains(9)
    prompts, expected = tiny_expected
    assert engine.generate([prompts[0], prompts[3]], max_new_tokens=MAX_NEW, lora_task_ids=[7, 9],
                           end_id=2) == [expected[0], expected[3]]


def test_bf16_engine_stays_close_to_bf16_peft(tiny_model_dir, tiny_adapters, tiny_expected):
    """Tolerance: bf16 rounding differs between the two (fused projections, folded scale), so greedy paths may
    part late; we require the first 4 tokens to agree for at least 8 of the 10 requests."""
    prompts, _ = tiny_expected
    peft = peft_model_with(tiny_model_dir, tiny_adapters, dtype=torch.bfloat16)
    expected = [peft_greedy(peft, p, "__base__" if t is None else f"a{t - 1}", MAX_NEW) for p, t in zip(prompts, TASKS)]
    engine = LLMEngine(tiny_model_dir, dtype="bfloat16", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    for task_id, path in enumerate(tiny_adapters, start=1):
        weights, config = peft_to_trtllm(path, "bfloat16")
        engine.add_lora(task_id, weights, config)
    got = engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=TASKS, end_id=2)
    assert sum(g[:4] == e[:4] for g, e in zip(got, expected)) >= 8


@pytest.mark.slow
@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_smollm2_mixed_batch_matches_peft(smollm2_dir, tmp_path, kernel_backend):
    adapters = make_peft_adapters(smollm2_dir, tmp_path, scale=0.05)
    peft = peft_model_with(smollm2_dir, adapters)
    tasks = [1, 2, None, 3, 4, 2]
    prompts = random_prompts([12, 30, 7, 22, 16, 9], 49152, seed=5)
    expected = [peft_greedy(peft, p, "__base__" if t is None else f"a{t - 1}", 8) for p, t in zip(prompts, tasks)]
    engine = LLMEngine(smollm2_dir, dtype="float32", kernel_backend=kernel_backend, kv_cache_memory_bytes=64 << 20,
                       max_loras=4)
    for task_id, path in enumerate(adapters, start=1):
        engine.add_lora_dir(task_id, path)
    assert engine.generate(prompts, max_new_tokens=8, lora_task_ids=tasks, end_id=2) == expected


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_fp16_adapters_beside_an_fp32_model_lose_nothing_sent_as_fp16(tiny_model_dir, tiny_adapters, tiny_expected,
                                                                      kernel_backend):
    """lora_dtype float16 (auto's choice for an fp32 model on the compiled kernels) gives fp32 storage's tokens for
    adapters sent as FP16, the TensorRT-LLM clients' dtype, in half the bytes."""
    prompts, _ = tiny_expected
    engines = {}
    for lora_dtype in ("float16", "float32"):
        engines[lora_dtype] = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend=kernel_backend,
                                        kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=24, lora_dtype=lora_dtype)
        for task_id, path in enumerate(tiny_adapters, start=1):
            engines[lora_dtype].add_lora(task_id, *peft_to_trtllm(path, "float16"))
    half, full = engines["float16"].lora_cache, engines["float32"].lora_cache
    assert half.slots.a[0]["qkv"].dtype == torch.float16 and half.host[1].weights[(0, 1)][0].dtype == torch.float16
    assert 2 * half.stats.host_bytes == full.stats.host_bytes
    assert run_mixed(engines["float16"], prompts, end_id=2) == run_mixed(engines["float32"], prompts, end_id=2)

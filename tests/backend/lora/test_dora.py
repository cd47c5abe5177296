"""DoRA through every path (torch, the compiled CPU kernels, the Triton kernels in the interpreter, tensor parallel),
against PEFT with use_dora=True in fp32: a batch mixing base rows, two LoRA and two DoRA adapters of other ranks
(one rsLoRA) answers as PEFT does row by row (PEFT will not mix DoRA adapters in a batch); the same adapters as
TensorRT-LLM's four-column tensors (scripts/hf_lora_convert.py --base-model) answer the same; a plain adapter in
four columns answers as in three; and what a DoRA row cannot be is refused, naming the row."""
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from backend import LLMEngine, RequestError
from backend import device as device_module
from backend.lora.dora import checkpoint_weights, normalized_magnitude
from backend.lora.peft import load_lora_dir, peft_to_trtllm
from tests.helpers import (ALL_MODULES, CPU_BACKENDS, CUDA_MARKS, INTERPRETER_MARK, ROOT, cpu_kernels_build,
                           make_peft_adapters, peft_greedy_alone, peft_model_with, random_prompts,
                           with_kv_rounded, with_projections_rounded)

SPECS = [dict(r=4, lora_alpha=8, target_modules=ALL_MODULES),                           # LoRA
         dict(r=8, lora_alpha=16, use_dora=True, target_modules=ALL_MODULES),          # DoRA
         dict(r=16, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),   # LoRA
         dict(r=12, lora_alpha=24, use_dora=True, use_rslora=True,                      # DoRA, rsLoRA
              target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])]
TASKS = [1, None, 2, 3, 4, 2, None, 4]                       # base rows between adapters of both kinds
LENGTHS = [9, 14, 5, 22, 17, 11, 30, 7]
MAX_NEW = 10


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return make_peft_adapters(tiny_model_dir, tmp_path_factory.mktemp("dora"), specs=SPECS, seed=21)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """PEFT's greedy tokens, each row alone with its adapter active."""
    peft = peft_model_with(tiny_model_dir, adapters)
    prompts = random_prompts(LENGTHS, 512, seed=41)
    return [peft_greedy_alone(peft, p, None if t is None else f"a{t - 1}", MAX_NEW) for p, t in zip(prompts, TASKS)]


def engine_answers(model_dir, adapter_dirs, **settings) -> list[list[int]]:
    engine = LLMEngine(model_dir, dtype="float32", kv_cache_memory_bytes=1 << 20, **settings)
    try:
        for task_id, path in enumerate(adapter_dirs, start=1):
            engine.add_lora_dir(task_id, path)
        return engine.generate(random_prompts(LENGTHS, 512, seed=41), max_new_tokens=MAX_NEW, lora_task_ids=TASKS)
    finally:
        engine.close()


def test_the_dora_adapters_change_tokens_beyond_their_lora_parts(tiny_model_dir, adapters, expected):
    """The oracle is not trivial: without its magnitudes a DoRA adapter answers otherwise."""
    peft = peft_model_with(tiny_model_dir, adapters)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_magnitude_vector" in name:
                param.fill_(1.0)
    prompts = random_prompts(LENGTHS, 512, seed=41)
    rows = [i for i, t in enumerate(TASKS) if t in (2, 4)]
    assert any(peft_greedy_alone(peft, prompts[i], f"a{TASKS[i] - 1}", MAX_NEW) != expected[i] for i in rows)


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS + [pytest.param("triton", marks=INTERPRETER_MARK)])
def test_a_mixed_lora_and_dora_batch_matches_peft(tiny_model_dir, adapters, expected, kernel_backend):
    assert engine_answers(tiny_model_dir, adapters, kernel_backend=kernel_backend) == expected


@pytest.mark.skipif(not cpu_kernels_build(), reason="the compiled CPU kernels do not build here")
def test_dora_over_bf16_weights_beside_fp32_matches_peft_over_those_weights(tiny_model_dir, adapters, monkeypatch):
    """dtype auto on a CPU without bf16 arithmetic serves bf16 projections (and a bf16 KV cache) beside fp32
    activations (backend.device.projection_dtype): the magnitudes normalize against those (not the checkpoint's fp32
    values), as PEFT's do over the same weights and K, V rounded alike."""
    monkeypatch.setattr(device_module, "cpu_has_native_bf16", lambda: False)
    engine = LLMEngine(tiny_model_dir, kernel_backend="cpu", kv_cache_memory_bytes=1 << 20)
    sent, add_lora = {}, engine.add_lora

    def add_and_keep(task_id, weights, config):
        sent[task_id] = weights
        add_lora(task_id, weights, config)
    monkeypatch.setattr(engine, "add_lora", add_and_keep)
    try:
        assert engine.runner.projection_dtype == torch.bfloat16
        for task_id, path in enumerate(adapters, start=1):
            engine.add_lora_dir(task_id, path)
        served, checkpoint = (load_lora_dir(adapters[1], checkpoint_weights(tiny_model_dir, dtype))[0]
                              for dtype in (torch.bfloat16, torch.float32))
        assert np.array_equal(sent[2], served) and not np.array_equal(sent[2], checkpoint)
        prompts = random_prompts(LENGTHS, 512, seed=41)
        got = engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=TASKS)
    finally:
        engine.close()
    peft = with_kv_rounded(with_projections_rounded(peft_model_with(tiny_model_dir, adapters), torch.bfloat16),
                           torch.bfloat16)
    names = [None if t is None else f"a{t - 1}" for t in TASKS]
    assert got == [peft_greedy_alone(peft, p, name, MAX_NEW) for p, name in zip(prompts, names)]


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_a_mixed_lora_and_dora_batch_matches_peft_on_cuda(tiny_model_dir, adapters, expected, device):
    assert engine_answers(tiny_model_dir, adapters, device=device) == expected


def test_four_column_tensors_from_the_converter_answer_the_same(tiny_model_dir, adapters, expected, tmp_path):
    """scripts/hf_lora_convert.py --base-model writes TensorRT-LLM's four-column tensors, magnitudes normalized."""
    converted = []
    for i, path in enumerate(adapters):
        out = tmp_path / f"trt{i}"
        run = subprocess.run([sys.executable, ROOT / "scripts" / "hf_lora_convert.py", "-i", path, "-o", out,
                              "--storage-type", "float32", "--base-model", tiny_model_dir],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        config = np.load(out / "model.lora_config.npy")
        assert config.shape[-1] == (4 if SPECS[i].get("use_dora") else 3)
        converted.append(out)
    assert engine_answers(tiny_model_dir, converted, kernel_backend="torch") == expected


def test_tensor_parallel_dora_answers_equal_peft(tiny_model_dir, adapters, expected):
    """Column modules split the magnitude with B; row modules scale each rank's partial by the whole vector."""
    assert engine_answers(tiny_model_dir, adapters, kernel_backend="torch", tensor_parallel_size=2) == expected


def test_a_plain_adapter_in_four_columns_answers_as_in_three(tiny_model_dir, adapters):
    weights, config = load_lora_dir(adapters[0])
    four = np.concatenate([config, np.zeros((len(config), 1), np.int32)], axis=1)
    prompts = random_prompts([9, 13], 512, seed=42)
    answers = []
    for cfg in (config, four):
        engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
        engine.add_lora(1, weights, cfg)
        answers.append(engine.generate(prompts, max_new_tokens=8, lora_task_ids=[1, 1]))
    assert answers[0] == answers[1]


def dora_row(cfg, rank: int = 4, module: int = 1, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """One DoRA row of q_proj on layer 0: A, B, a magnitude near 1."""
    from backend.lora.format import module_shape
    in_dim, out_dim = module_shape(cfg, module)
    rng = np.random.default_rng(seed)
    row = np.concatenate([rng.normal(0, 0.1, rank * (in_dim + out_dim)), 1 + rng.normal(0, 0.1, out_dim)])
    return row.astype(np.float32), [module, 0, rank, 1]


@pytest.mark.parametrize("case, words", [
    ("is_dora 2", "row 0: is_dora must be 0 or 1, got 2"),
    ("no magnitude", "row 0 has 512 values, module 1 (attn_q) rank 4 with its DoRA magnitude needs 576"),
    ("nan magnitude", "NaN or Inf"), ("inf magnitude", "NaN or Inf")])
def test_what_a_dora_row_cannot_be_is_refused_naming_the_row(tiny_model_dir, case, words):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    row, config = dora_row(engine.model_config)
    if case == "is_dora 2":
        config[3] = 2
    elif case == "no magnitude":
        row = row[:4 * (64 + 64)]
    else:
        row[-3] = np.nan if case == "nan magnitude" else np.inf
    with pytest.raises(RequestError, match=re.escape(words)):
        engine.add_lora(1, row[None], np.array([config], np.int32))
    engine.add_lora(2, *map(lambda a: a[None], (dora_row(engine.model_config)[0], np.array(dora_row(
        engine.model_config)[1], np.int32))))                          # a good one still goes in
    assert engine.generate([[5, 6, 7]], max_new_tokens=3, lora_task_ids=[2])


def test_a_peft_dora_magnitude_of_the_wrong_length_or_a_zero_norm_is_refused(tiny_model_dir, adapters, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    broken = tmp_path / "wrong-length"
    shutil.copytree(adapters[1], broken)
    tensors = load_file(broken / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("q_proj.lora_magnitude_vector"))
    tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, broken / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="magnitude of shape \\[63\\], the module has 64 output features"):
        peft_to_trtllm(broken, "float32", checkpoint_weights(tiny_model_dir))
    weight = torch.randn(4, 6)
    weight[2] = 0                                               # a row of W + s·B·A that is all zero
    with pytest.raises(ValueError, match="zero for an output row"):
        normalized_magnitude(torch.ones(4), torch.zeros(2, 6), torch.zeros(4, 2), weight, "q_proj")
    with pytest.raises(ValueError, match="needs the base model's weights"):
        peft_to_trtllm(adapters[1], "float32")


@pytest.mark.slow
def test_smollm2_mixed_lora_and_dora_batch_matches_peft(smollm2_dir, tmp_path):
    specs = [dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
             dict(r=16, lora_alpha=16, use_dora=True, use_rslora=True, target_modules=ALL_MODULES)]
    paths = make_peft_adapters(smollm2_dir, tmp_path, specs=specs, seed=3, scale=0.3)
    prompts = random_prompts([12, 20, 9], 49152, seed=43)
    tasks = [2, None, 1]
    engine = LLMEngine(smollm2_dir, dtype="float32", kv_cache_memory_bytes=64 << 20)
    for task_id, path in enumerate(paths, start=1):
        engine.add_lora_dir(task_id, path)
    got = engine.generate(prompts, max_new_tokens=8, lora_task_ids=tasks)
    peft = peft_model_with(smollm2_dir, paths)
    assert got == [peft_greedy_alone(peft, p, None if t is None else f"a{t - 1}", 8) for p, t in zip(prompts, tasks)]

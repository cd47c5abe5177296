"""Weight-only INT8, INT4 and FP8 weights (weight_dtype int8, int4, fp8): the engine's greedy tokens equal
transformers' on the model those weights encode, dequantized here by the test's own lines from each format's
definition; adapters, DoRA among them, equal PEFT on that model."""
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import LLMEngine
from backend.config import EngineConfig
from kernels.quant import Fp8Weight, Int4Weight, Int8Weight
from tests.backend.lora.test_lora_peft import LENGTHS, MAX_NEW, TASKS, run_mixed
from tests.helpers import (ALL_MODULES, CPU_BACKENDS, INTERPRETER_MARK, hf_greedy, make_peft_adapters, peft_greedy,
                           peft_greedy_alone, peft_model_with, random_prompts)

PATHS = CPU_BACKENDS + [pytest.param("triton", marks=INTERPRETER_MARK)]    # the Triton kernels: the interpreter
WEIGHT_TYPES = {"int8": Int8Weight, "int4": Int4Weight, "fp8": Fp8Weight}


def int8_encoded(w: torch.Tensor) -> torch.Tensor:
    """Every row rounded to a step of its own max |w| / 127 (an all-zero row stays zero)."""
    step = w.abs().amax(dim=1, keepdim=True) / 127
    step[step == 0] = 1.0
    return (w / step).round().clamp(-127, 127) * step


def int4_encoded(w: torch.Tensor) -> torch.Tensor:
    """Every row's groups of 128 inputs (64, 32 where the width asks) rounded to one of 16 steps of (max - min) / 15
    that span [min(w, 0), max(w, 0)], 0 among them."""
    group = next(size for size in (128, 64, 32) if w.shape[1] % size == 0)
    groups = w.view(w.shape[0], -1, group)
    lo, hi = groups.amin(dim=2, keepdim=True).clamp(max=0), groups.amax(dim=2, keepdim=True).clamp(min=0)
    step = (hi - lo) / 15
    step[step == 0] = 1.0
    zero = torch.round(-lo / step)
    return ((torch.round(groups / step) + zero).clamp(0, 15) - zero).mul(step).view(w.shape)


def fp8_encoded(w: torch.Tensor) -> torch.Tensor:
    """Every row scaled to e4m3's range (max |w| -> 448), rounded to e4m3 (torch's float8_e4m3fn), scaled back."""
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    scale[scale == 0] = 1.0
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def dequantized_copy(model_dir: Path, out: Path, weight_dtype: str) -> Path:
    """The model weight_dtype encodes: every projection's weight as that format rounds it, saved in fp32."""
    encoded = {"int8": int8_encoded, "int4": int4_encoded, "fp8": fp8_encoded}[weight_dtype]
    shutil.copytree(model_dir, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for key, w in tensors.items():
            if key.endswith(tuple(f"{name}.weight" for name in ALL_MODULES)):
                tensors[key] = encoded(w.float())
        save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=["int8", "int4", "fp8"])
def weight_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def encoded_dir(tiny_model_dir, weight_dtype, tmp_path_factory):
    return dequantized_copy(Path(tiny_model_dir), tmp_path_factory.mktemp(weight_dtype) / "model", weight_dtype)


def quantized_engine(model_dir, kernel_backend: str, weight_dtype: str) -> LLMEngine:
    return LLMEngine(model_dir, dtype="float32", weight_dtype=weight_dtype, kernel_backend=kernel_backend,
                     kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=24)


def quantized_bytes(out_dim: int, in_dim: int, weight_dtype: str) -> int:
    """A projection's bytes in the format: INT8 and FP8 a byte a value and an fp32 scale a row; INT4 half a byte a
    value, an fp32 scale and a uint8 zero point a group of a row."""
    if weight_dtype in ("int8", "fp8"):
        return out_dim * in_dim + 4 * out_dim
    group = next(size for size in (128, 64, 32) if in_dim % size == 0)
    return out_dim * in_dim // 2 + 5 * out_dim * (in_dim // group)


def assert_tokens_match_transformers(engine: LLMEngine, encoded_dir: Path, original: LLMEngine | None = None) -> None:
    """The engine's greedy tokens == transformers' on encoded_dir (the fp32 model its weights encode), and, given
    the original model's engine, != its tokens: the rounding changes some token here, so the check can tell."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(encoded_dir, dtype=torch.float32).eval()
    prompts = random_prompts([5, 21, 9, 33, 3, 17], engine.model_config.vocab_size, seed=5)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    eos = engine.model_config.eos_token_id
    assert engine.generate(prompts, max_new_tokens=MAX_NEW, end_id=eos) == expected
    if original is not None:
        assert original.generate(prompts, max_new_tokens=MAX_NEW, end_id=eos) != expected, \
            "the rounding changes some token here: the check can tell"


def assert_two_ranks_keep_and_answer_one_ranks_tokens(model_dir: Path, kept: str, weight_type: type) -> None:
    """At tensor_parallel_size 1 and 2 the weight named `kept` is a weight_type, and the two answer the same
    greedy tokens."""
    answers = []
    for tp_size in (1, 2):
        engine = LLMEngine(model_dir, dtype="float32", kernel_backend="torch", tensor_parallel_size=tp_size,
                           kv_cache_memory_bytes=1 << 20)
        try:
            assert isinstance(engine.runner.model.w[kept], weight_type)
            answers.append(engine.generate([[5, 9, 3, 71, 2, 8], [44, 11]], max_new_tokens=8))
        finally:
            engine.close()
    assert answers[1] == answers[0]


def assert_adapters_match_peft(engine: LLMEngine, encoded_dir: Path, adapters: list[Path]) -> None:
    """Four adapters (ranks 4-64, one on attention only) and base rows mixed in one batch, requests joining as
    others decode: the engine's tokens == PEFT's on encoded_dir."""
    peft = peft_model_with(encoded_dir, adapters)
    prompts = random_prompts(LENGTHS, 512, seed=21)
    expected = [peft_greedy(peft, p, "__base__" if t is None else f"a{t - 1}", MAX_NEW)
                for p, t in zip(prompts, TASKS)]
    for task_id, path in enumerate(adapters, start=1):
        engine.add_lora_dir(task_id, path)
    assert run_mixed(engine, prompts, end_id=2) == expected


@pytest.mark.parametrize("kernel_backend", PATHS)
def test_quantized_weights_match_transformers_on_the_model_they_encode(tiny_model_dir, encoded_dir, weight_dtype,
                                                                       kernel_backend):
    engine = quantized_engine(tiny_model_dir, kernel_backend, weight_dtype)
    full = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend=kernel_backend, kv_cache_memory_bytes=1 << 20)
    assert all(isinstance(engine.runner.model.w[f"layers.{i}.{proj}_proj"], WEIGHT_TYPES[weight_dtype])
               for i in range(engine.model_config.num_layers) for proj in ("qkv", "o", "gate_up", "down"))
    shapes = [w.shape for name, w in engine.runner.model.w.items() if name.endswith("_proj")]
    saved = sum(4 * n * k - quantized_bytes(n, k, weight_dtype) for n, k in shapes)
    assert engine.runner.weight_bytes == full.runner.weight_bytes - saved
    assert_tokens_match_transformers(engine, encoded_dir, full)


@pytest.mark.parametrize("kernel_backend", PATHS)
def test_adapters_over_quantized_weights_match_peft_on_the_model_they_encode(tiny_model_dir, encoded_dir,
                                                                             weight_dtype, tiny_adapters,
                                                                             kernel_backend):
    assert_adapters_match_peft(quantized_engine(tiny_model_dir, kernel_backend, weight_dtype), encoded_dir,
                               tiny_adapters)


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_a_dora_adapter_normalizes_against_the_served_quantized_weights(tiny_model_dir, encoded_dir, weight_dtype,
                                                                        tmp_path, kernel_backend):
    """Its magnitudes divide by ||W + s B A|| of the dequantized W, as PEFT on the model the weights encode takes
    them."""
    [path] = make_peft_adapters(tiny_model_dir, tmp_path, [dict(r=8, lora_alpha=16, use_dora=True,
                                                                target_modules=ALL_MODULES)], seed=7)
    peft = peft_model_with(encoded_dir, [path])
    prompts = random_prompts([6, 19, 12], 512, seed=8)
    engine = quantized_engine(tiny_model_dir, kernel_backend, weight_dtype)
    engine.add_lora_dir(1, path)
    expected = [peft_greedy_alone(peft, p, "a0", MAX_NEW) for p in prompts]
    assert engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=[1] * len(prompts),
                           end_id=engine.model_config.eos_token_id) == expected


def lm_head_encoded_copy(model_dir: Path, out: Path, lm_head_dtype: str, tied: bool) -> tuple[Path, Path]:
    """(the model, the model its weights encode with lm_head_dtype): the tiny model, tied (no lm_head.weight: the
    embeddings serve) or not; beside it the same with only its LM head rounded by that format, untied."""
    import json
    encoded = {"int8": int8_encoded, "int4": int4_encoded, "fp8": fp8_encoded}[lm_head_dtype]
    served, reference_dir = out / "served", out / "encoded"
    for path, rounded in ((served, False), (reference_dir, True)):
        shutil.copytree(model_dir, path)
        config = json.loads((path / "config.json").read_text())
        config["tie_word_embeddings"] = tied and not rounded
        (path / "config.json").write_text(json.dumps(config))
        [file] = path.glob("*.safetensors")
        tensors = load_file(file)
        if tied:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        head = tensors.pop("lm_head.weight")
        if rounded or not tied:
            tensors["lm_head.weight"] = encoded(head.float()) if rounded else head
        save_file(tensors, file, metadata={"format": "pt"})
    return served, reference_dir


@pytest.mark.parametrize("kernel_backend", PATHS)
@pytest.mark.parametrize("lm_head_dtype", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_quantized_lm_head_matches_transformers_on_the_model_it_encodes(tiny_model_dir, tmp_path, lm_head_dtype,
                                                                          tied, kernel_backend):
    """lm_head_dtype: the LM head alone in the format (the projections as stored), a tied one beside the
    embeddings, which stay as they are; its bytes are the format's."""
    served, encoded = lm_head_encoded_copy(Path(tiny_model_dir), tmp_path, lm_head_dtype, tied)
    engine = LLMEngine(served, dtype="float32", lm_head_dtype=lm_head_dtype, kernel_backend=kernel_backend,
                       kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=24)
    full = LLMEngine(served, dtype="float32", kernel_backend=kernel_backend, kv_cache_memory_bytes=1 << 20)
    w = engine.runner.model.w
    assert isinstance(w["lm_head"], WEIGHT_TYPES[lm_head_dtype]) and w["embed_tokens"].dtype == torch.float32
    assert isinstance(w["layers.0.qkv_proj"], torch.Tensor)
    vocab, hidden = engine.model_config.vocab_size, engine.model_config.hidden_size
    assert engine.runner.weight_bytes == full.runner.weight_bytes - 4 * vocab * hidden + quantized_bytes(
        vocab, hidden, lm_head_dtype)
    assert_tokens_match_transformers(engine, encoded)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(encoded, dtype=torch.float32).eval()
    [prompt] = random_prompts([40], vocab, seed=9)
    with torch.inference_mode():
        want = hf(input_ids=torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    want = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]       # position i - 1 scores token i
    torch.testing.assert_close(prompt_log_probs(engine, prompt), want, atol=1e-4, rtol=0)
    assert float((prompt_log_probs(full, prompt) - want).abs().max()) > 1e-3, "the rounding shows: the check can tell"


def prompt_log_probs(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """The engine's log prob of each prompt token after the first, given those before it."""
    engine.add_request(prompt, max_new_tokens=1, return_prompt_log_probs=True)
    scored = []
    while engine.has_unfinished:
        scored += [out.prompt_log_probs for out in engine.step() if out.prompt_log_probs is not None]
    return scored[0].log_probs[1:]


def test_an_lm_head_dtype_the_head_cannot_take_is_refused_by_name(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"lm_head_dtype must be one of \('auto', 'int8', 'int4', 'fp8'\), got 'q4'"):
        EngineConfig(model_dir="unused", lm_head_dtype="q4")
    narrow = tmp_path / "narrow"
    from scripts.prepare_model import build_tiny
    build_tiny(narrow, seed=0, architecture="llama", hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="lm_head_dtype int4: .*48 input channels"):
        LLMEngine(narrow, dtype="float32", lm_head_dtype="int4", kernel_backend="torch")


def test_a_weight_dtype_not_served_is_refused_by_name():
    with pytest.raises(ValueError, match=r"weight_dtype must be one of \('auto', 'int8', 'int4', 'fp8'\), got 'int3'"):
        EngineConfig(model_dir="unused", weight_dtype="int3")


@pytest.mark.parametrize("weight_dtype", ["int8", "int4", "fp8"])
def test_the_openai_api_normalizes_a_dora_adapter_against_the_served_weights(tiny_model_dir, tmp_path, weight_dtype):
    """The API's reader (frontend/tensors.read_tensors, --weight-dtype) sends the magnitudes the engine would take
    from the same PEFT directory, not those of the checkpoint's own weights."""
    from backend.model.checkpoint import ModelConfig
    from backend.lora.dora import checkpoint_weights
    from backend.lora.peft import peft_to_trtllm
    from frontend.tensors import AdapterLimits, read_tensors
    [path] = make_peft_adapters(tiny_model_dir, tmp_path, [dict(r=8, lora_alpha=16, use_dora=True,
                                                                target_modules=ALL_MODULES)], seed=9)
    model = ModelConfig.from_dir(tiny_model_dir)
    sent = {dtype: read_tensors(path, AdapterLimits(model, 64, str(tiny_model_dir), dtype))[0]
            for dtype in ("auto", weight_dtype)}
    engine_takes, _ = peft_to_trtllm(path, "float16", checkpoint_weights(tiny_model_dir, weight_dtype=weight_dtype))
    assert np.array_equal(sent[weight_dtype], engine_takes)
    assert not np.array_equal(sent["auto"], engine_takes)

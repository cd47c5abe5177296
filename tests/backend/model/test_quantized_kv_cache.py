"""INT8 and FP8 KV caches (kv_cache_dtype int8, fp8): the engine's greedy tokens equal transformers' with an
attention that quantizes and dequantizes K and V the same way (the test's own lines: INT8 floor(x / scale + 0.5)
clamped to +-127, FP8 x / scale clamped to +-448 and rounded to e4m3 by torch, times scale), on every kernel path;
INT8's scales are each layer's largest K and V magnitudes / 127 over the calibration text's prefill, FP8's 1.0
(TensorRT-LLM's default); either cache holds 2x a bf16 cache's tokens for the same bytes (4x fp32's)."""
import pytest
import torch

from backend import LLMEngine
from backend.config import EngineConfig
from backend.model.calibration import calibration_ids
from tests.backend.model.test_quantized import PATHS
from tests.helpers import hf_greedy, random_prompts

MAX_NEW = 12


def fake_quantized(x: torch.Tensor, scale: float, kind: str = "int8") -> torch.Tensor:
    """x as an INT8 cache gives it back (its step of `scale`, rounded half up, at most 127 steps from 0) or an FP8
    one (x / scale within +-448, rounded to e4m3, times scale)."""
    scaled = x.float() / torch.tensor(scale, dtype=torch.float32)
    if kind == "fp8":
        return scaled.clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return torch.clamp(torch.floor(scaled + 0.5), -127, 127) * scale


def hf_model(model_dir, scales: list[tuple[float, float]] | None = None, seen: list | None = None,
             kind: str = "int8"):
    """transformers' model whose attention sees K and V through fake_quantized with scales (by layer); seen: each
    layer's (K, V) as the attention gets them, appended."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        if seen is not None:
            seen.append((module.layer_idx, key.clone(), value.clone()))
        if scales is not None:
            k_scale, v_scale = scales[module.layer_idx]
            key, value = fake_quantized(key, k_scale, kind), fake_quantized(value, v_scale, kind)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)
    AttentionInterface.register("int8_kv_test", attention)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="int8_kv_test").eval()


def engine_with(model_dir, kernel_backend: str, kv_cache_dtype: str = "int8") -> LLMEngine:
    return LLMEngine(model_dir, dtype="float32", kv_cache_dtype=kv_cache_dtype, kernel_backend=kernel_backend,
                     kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=24)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("kernel_backend", PATHS)
def test_quantized_cache_tokens_match_transformers_quantizing_kv_the_same_way(tiny_model_dir, kernel_backend, kind):
    """Scales coarse enough that the rounding changes tokens (the check can tell: INT8's 16x the calibrated ones,
    FP8's 64, its small values then e4m3's subnormals): the engine's tokens equal transformers' through the same
    rounding, not the unquantized engine's; prompts chunked (24 tokens a step) beside decodes."""
    engine = engine_with(tiny_model_dir, kernel_backend, kind)
    scales = [(16 * k, 16 * v) if kind == "int8" else (64.0, 64.0) for k, v in engine.runner.model.kv_scales]
    engine.runner.model.kv_scales = scales
    prompts = random_prompts([5, 21, 9, 33, 3, 17], engine.model_config.vocab_size, seed=5)
    hf = hf_model(tiny_model_dir, scales, kind=kind)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    got = engine.generate(prompts, max_new_tokens=MAX_NEW, end_id=engine.model_config.eos_token_id)
    assert got == expected
    plain = engine_with(tiny_model_dir, kernel_backend, "auto")
    assert plain.generate(prompts, max_new_tokens=MAX_NEW, end_id=plain.model_config.eos_token_id) != expected, \
        "the rounding changes some token here: the check can tell"


@pytest.mark.parametrize("kernel_backend", PATHS)
def test_an_fp8_cache_has_scales_of_one_and_matches_transformers_so(tiny_model_dir, kernel_backend):
    engine = engine_with(tiny_model_dir, kernel_backend, "fp8")
    assert engine.runner.model.kv_scales == [(1.0, 1.0)] * engine.model_config.num_layers
    assert engine.runner.kv_caches[0][0].dtype == torch.uint8
    prompts = random_prompts([7, 30, 2], engine.model_config.vocab_size, seed=6)
    hf = hf_model(tiny_model_dir, engine.runner.model.kv_scales, kind="fp8")
    assert engine.generate(prompts, max_new_tokens=MAX_NEW, end_id=engine.model_config.eos_token_id) == \
        [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("kernel_backend", PATHS)
def test_scales_are_the_calibration_prefills_largest_magnitudes_over_127(tiny_model_dir, kernel_backend):
    engine = engine_with(tiny_model_dir, kernel_backend)
    seen = []
    hf = hf_model(tiny_model_dir, seen=seen)
    ids = calibration_ids(str(tiny_model_dir), engine.model_config.vocab_size, 1 << 20)
    with torch.no_grad():
        hf(torch.tensor([ids]))
    want = [(k.abs().max().item() / 127, v.abs().max().item() / 127) for _, k, v in sorted(seen, key=lambda s: s[0])]
    assert len(want) == engine.model_config.num_layers
    torch.testing.assert_close(torch.tensor(engine.runner.model.kv_scales), torch.tensor(want), rtol=1e-4, atol=0)
    assert engine.runner.kv_caches[0][0].dtype == torch.int8


def test_a_quantized_cache_holds_four_times_an_fp32_caches_blocks(tiny_model_dir):
    blocks = {dtype: engine_with(tiny_model_dir, "torch", dtype).runner.num_blocks for dtype in ("auto", "int8", "fp8")}
    assert blocks["int8"] == blocks["fp8"] == 4 * blocks["auto"] > 0


def test_a_kv_cache_dtype_not_served_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'int8', 'fp8'\), got 'int4'"):
        EngineConfig(str(tiny_model_dir), kv_cache_dtype="int4")


def test_two_ranks_with_an_fp8_cache_answer_one_ranks_tokens(tiny_model_dir):
    prompts = random_prompts([5, 21, 9, 33], 512, seed=8)
    want = engine_with(tiny_model_dir, "torch", "fp8").generate(prompts, max_new_tokens=MAX_NEW)
    two = LLMEngine(tiny_model_dir, dtype="float32", kv_cache_dtype="fp8", kernel_backend="torch",
                    kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=24, tensor_parallel_size=2)
    try:
        assert two.generate(prompts, max_new_tokens=MAX_NEW) == want
    finally:
        two.close()


def test_two_ranks_calibrate_one_ranks_scales_and_answer_its_tokens(tiny_model_dir):
    """Under tensor parallelism each rank writes its KV heads: the calibration's largest magnitudes are reduced over
    the ranks, so every rank holds one rank's scales (to the rounding of the ranks' sums), and the tokens are one
    rank's."""
    prompts = random_prompts([5, 21, 9, 33], 512, seed=7)
    one = engine_with(tiny_model_dir, "torch")
    want = one.generate(prompts, max_new_tokens=MAX_NEW)
    two = LLMEngine(tiny_model_dir, dtype="float32", kv_cache_dtype="int8", kernel_backend="torch",
                    kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=24, tensor_parallel_size=2)
    try:
        torch.testing.assert_close(torch.tensor(two.runner.model.kv_scales), torch.tensor(one.runner.model.kv_scales),
                                   rtol=1e-5, atol=0)                 # (the ranks' sums round differently)
        assert two.generate(prompts, max_new_tokens=MAX_NEW) == want
    finally:
        two.close()

"""FP8 checkpoints as published (quant_method fp8 with block scales, compressed-tensors float-quantized with channel or
tensor scales): the engine's greedy tokens equal transformers' on the model the checkpoint encodes, dequantized
here by the test's own lines from the format's definition; adapters equal PEFT on that model; int8 serving of an
FP8 checkpoint equals its int8 rounding; what is not read is refused by name. Weights whose scales are one a
tensor, a row or a block of 32s of columns stay in e4m3 (kernels.quant.Fp8Weight); blocks of 48 columns are served
dequantized."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import LLMEngine
from backend.lora.dora import checkpoint_weights
from kernels.quant import Fp8Weight
from tests.backend.lora.test_lora_peft import MAX_NEW
from tests.backend.model.test_quantized import (PATHS, assert_adapters_match_peft, assert_tokens_match_transformers,
                                                assert_two_ranks_keep_and_answer_one_ranks_tokens, dequantized_copy)
from tests.helpers import ALL_MODULES, CPU_BACKENDS, build_tiny, hf_greedy, random_prompts

FP8_MAX = 448.0                                            # e4m3's largest finite value
BLOCK = (32, 48)                                           # rows x cols: 48 leaves partial blocks of 64 and 128 cols
LAYOUTS = {
    "fp8 blocks": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": list(BLOCK)},
    "fp8 blocks of 32": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [16, 32]},
    "compressed-tensors channel": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False},
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                        "dynamic": False}}}},
    "compressed-tensors tensor": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}}}},
}


KEPT = ("fp8 blocks of 32", "compressed-tensors channel", "compressed-tensors tensor")


def scale_groups(rows: int, cols: int, layout: str) -> list[tuple[slice, slice]]:
    """The (rows, cols) ranges that share one scale."""
    if layout.startswith("fp8 blocks"):
        block = LAYOUTS[layout]["weight_block_size"]
        return [(slice(r, r + block[0]), slice(c, c + block[1])) for r in range(0, rows, block[0])
                for c in range(0, cols, block[1])]
    if layout.endswith("channel"):
        return [(slice(r, r + 1), slice(0, cols)) for r in range(rows)]
    return [(slice(0, rows), slice(0, cols))]


def fp8_checkpoint(model_dir: Path, out: Path, layout: str) -> Path:
    """The model written in an FP8 layout by the test's own packer: each projection's groups scaled to e4m3's range
    (scale = max |w| / 448), the scale stored as the format names it; embeddings, norms and LM head as they are."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": LAYOUTS[layout]}))
    suffix = "weight_scale_inv" if layout.startswith("fp8 blocks") else "weight_scale"
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for key in [k for k in tensors if k.endswith(tuple(f"{m}.weight" for m in ALL_MODULES))]:
            w = tensors[key].float()
            groups = scale_groups(*w.shape, layout)
            scales = torch.tensor([max(w[g].abs().max().item(), 1e-12) / FP8_MAX for g in groups])
            q = torch.empty_like(w)
            for g, scale in zip(groups, scales):
                q[g] = w[g] / scale
            tensors[key] = q.to(torch.float8_e4m3fn)
            rows, cols = w.shape
            block = LAYOUTS[layout].get("weight_block_size")
            shape = {"compressed-tensors channel": (rows, 1), "compressed-tensors tensor": (1,)}.get(
                layout, block and (-(-rows // block[0]), -(-cols // block[1])))
            tensors[key.removesuffix("weight") + suffix] = scales.reshape(shape)
            if layout.endswith("channel"):
                tensors[key.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def dequantized(fp8_dir: Path, out: Path, layout: str) -> Path:
    """The fp32 model an FP8 checkpoint encodes: every e4m3 value times the scale of its group."""
    shutil.copytree(fp8_dir, out)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for key in [k for k in tensors if tensors[k].dtype == torch.float8_e4m3fn]:
            q = tensors.pop(key).float()
            scales = tensors.pop(key.removesuffix("weight") + ("weight_scale_inv" if layout.startswith("fp8 blocks")
                                                               else "weight_scale")).flatten()
            tensors.pop(key.removesuffix("weight") + "input_scale", None)
            w = torch.empty_like(q)
            for g, scale in zip(scale_groups(*q.shape, layout), scales):
                w[g] = q[g] * scale
            tensors[key] = w
        save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """layout -> (the FP8 checkpoint, the fp32 model it encodes)"""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for i, layout in enumerate(LAYOUTS):
        fp8 = fp8_checkpoint(Path(tiny_model_dir), root / f"fp8-{i}", layout)
        out[layout] = fp8, dequantized(fp8, root / f"fp32-{i}", layout)
    return out


def engine_for(model_dir, kernel_backend: str, **settings) -> LLMEngine:
    return LLMEngine(model_dir, dtype="float32", kernel_backend=kernel_backend, kv_cache_memory_bytes=1 << 20,
                     max_num_batched_tokens=24, **settings)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kernel_backend", PATHS)
def test_an_fp8_checkpoint_matches_transformers_on_the_model_it_encodes(tiny_model_dir, checkpoints, layout,
                                                                        kernel_backend):
    fp8_dir, fp32_dir = checkpoints[layout]
    engine = engine_for(fp8_dir, kernel_backend)
    projections = [w for name, w in engine.runner.model.w.items() if name.endswith("_proj")]
    assert all(isinstance(w, Fp8Weight) == (layout in KEPT) for w in projections)
    assert_tokens_match_transformers(engine, fp32_dir, engine_for(tiny_model_dir, kernel_backend))


@pytest.mark.parametrize("layout", ["fp8 blocks of 32", "compressed-tensors channel"])
def test_an_fp8_checkpoint_at_two_ranks_answers_one_ranks_tokens(checkpoints, layout):
    """Row-parallel shares of whole blocks, or of rows with one scale each, kept in e4m3."""
    assert_two_ranks_keep_and_answer_one_ranks_tokens(checkpoints[layout][0], "layers.1.o_proj", Fp8Weight)


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_an_fp8_mixture_of_experts_matches_transformers_on_the_model_it_encodes(tmp_path, kernel_backend):
    """Each expert's projections in FP8 blocks (the router unquantized, as published checkpoints leave it)."""
    build_tiny(tmp_path / "moe", seed=3, architecture="qwen3_moe")
    fp8_dir = fp8_checkpoint(tmp_path / "moe", tmp_path / "fp8", "fp8 blocks")
    assert_tokens_match_transformers(engine_for(fp8_dir, kernel_backend),
                                     dequantized(fp8_dir, tmp_path / "fp32", "fp8 blocks"))


@pytest.mark.parametrize("kernel_backend", PATHS)
def test_adapters_over_an_fp8_checkpoint_match_peft_on_the_model_it_encodes(checkpoints, tiny_adapters,
                                                                            kernel_backend):
    fp8_dir, fp32_dir = checkpoints["fp8 blocks"]
    assert_adapters_match_peft(engine_for(fp8_dir, kernel_backend), fp32_dir, tiny_adapters)


def test_int8_serving_of_an_fp8_checkpoint_is_its_int8_rounding(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM
    fp8_dir, fp32_dir = checkpoints["compressed-tensors channel"]
    hf = AutoModelForCausalLM.from_pretrained(dequantized_copy(fp32_dir, tmp_path / "int8", "int8"),
                                              dtype=torch.float32)
    engine = engine_for(fp8_dir, "torch", weight_dtype="int8")
    prompts = random_prompts([7, 26, 11], engine.model_config.vocab_size, seed=6)
    assert engine.generate(prompts, max_new_tokens=MAX_NEW, end_id=engine.model_config.eos_token_id) == \
        [hf_greedy(hf.eval(), p, MAX_NEW) for p in prompts]


def test_a_checkpoint_compressed_tensors_writes_is_read_as_the_model_it_encodes(tiny_model_dir, tmp_path):
    """The layout written by the library vLLM's FP8 checkpoints come from (its FP8_DYNAMIC scheme: per-channel
    weight scales, activations per token, which a weight-only reader leaves in the served dtype)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                        format="float-quantized"))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach()
            module.weight_scale.data.copy_(calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True),
                                                             scheme.weights)[0])
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(tmp_path / "fp8")
    compressor.update_config(tmp_path / "fp8")
    assert_tokens_match_transformers(engine_for(tmp_path / "fp8", "torch"),
                                     dequantized(tmp_path / "fp8", tmp_path / "fp32", "compressed-tensors channel"))


def test_dora_reads_the_weights_an_fp8_checkpoint_encodes(checkpoints):
    fp8_dir, fp32_dir = checkpoints["fp8 blocks"]
    served, encoded = checkpoint_weights(fp8_dir), checkpoint_weights(fp32_dir)
    for layer, module_id in ((0, 1), (1, 6), (1, 7)):
        assert torch.equal(served(layer, module_id), encoded(layer, module_id))


def edited(fp8_dir: Path, out: Path, quantization: dict | None = None, tensors: dict | None = None) -> Path:
    """The checkpoint with another quantization_config (None: as it is; {}: none, and the scales gone too) and
    tensors replaced."""
    shutil.copytree(fp8_dir, out)
    config = json.loads((out / "config.json").read_text())
    path = out / "model.safetensors"
    weights = load_file(path) | (tensors or {})
    if quantization is not None:
        config["quantization_config"] = quantization
    if quantization == {}:
        weights = {key: w for key, w in weights.items() if not key.endswith("weight_scale_inv")}
    (out / "config.json").write_text(json.dumps(config))
    save_file(weights, path, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("case,quantization,tensors,says", [
    ("e5m2", LAYOUTS["fp8 blocks"] | {"fmt": "e5m2"}, None, "quantization_config: fmt 'e5m2' is not read"),
    ("int kv cache scheme", LAYOUTS["compressed-tensors tensor"] | {"kv_cache_scheme": {"num_bits": 8, "type": "int"}},
     None, r"compressed-tensors kv_cache_scheme \('int', 8, 'tensor'\) is not read"),
    ("int4 packed", LAYOUTS["compressed-tensors tensor"] | {"format": "pack-quantized"}, None,
     "compressed-tensors format 'pack-quantized' is not read; read: fp8"),
    ("int weights", {**LAYOUTS["compressed-tensors tensor"], "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "channel"}}}}, None,
     r"config_groups.group_0.weights \('int', 8, 'channel'\) is not read"),
    ("no quantization_config", {}, None, "model.layers.0.self_attn.q_proj.weight is F8_E4M3 without a "
                                         "quantization_config"),
    ("a scale of the wrong shape", None, {"model.layers.1.mlp.up_proj.weight_scale_inv": torch.ones(3, 3)},
     r"model.layers.1.mlp.up_proj.weight: a scale of shape \[3, 3\] for a weight of shape \[128, 64\] in blocks"),
])
def test_what_an_fp8_checkpoint_holds_that_is_not_read_is_refused_by_name(checkpoints, tmp_path, case, quantization,
                                                                         tensors, says):
    path = edited(checkpoints["fp8 blocks"][0], tmp_path / "edited", quantization, tensors)
    with pytest.raises(ValueError, match=says):
        engine_for(path, "torch")


KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}


KV_LAYOUTS = {   # the checkpoint, its quantization_config, each layer's scale tensors
    "compressed-tensors": ("compressed-tensors tensor", LAYOUTS["compressed-tensors tensor"] | {"kv_cache_scheme":
                                                                                             KV_SCHEME},
                           ("k_scale", "v_scale")),
    "fp8 k_scale, v_scale": ("fp8 blocks", LAYOUTS["fp8 blocks"], ("k_scale", "v_scale")),      # vLLM's
    "fp8 kv_scale": ("fp8 blocks", LAYOUTS["fp8 blocks"], ("kv_scale",)),                       # AutoFP8's: K's and V's
}


@pytest.mark.parametrize("kernel_backend", PATHS)
@pytest.mark.parametrize("layout", list(KV_LAYOUTS))
def test_a_checkpoints_kv_scales_serve_an_fp8_cache(checkpoints, tmp_path, kernel_backend, layout):
    """Each layer's k_scale and v_scale (compressed-tensors' kv_cache_scheme, or an FP8 checkpoint's as vLLM reads
    them; AutoFP8's one kv_scale for both) are an FP8 cache's scales (coarse ones here, so that the rounding shows),
    the tokens transformers' with K and V rounded to e4m3 against them; a cache in dtype reads the checkpoint all
    the same."""
    from tests.backend.model.test_quantized_kv_cache import hf_model
    name, quantization, names = KV_LAYOUTS[layout]
    fp8_dir, fp32_dir = checkpoints[name]
    scales = [(8.0 * (i + 1), 16.0) if len(names) == 2 else (16.0, 16.0) for i in range(2)]
    kv = {f"model.layers.{i}.self_attn.{tensor}": torch.tensor([value]) for i, pair in enumerate(scales)
          for tensor, value in zip(names, pair)}
    path = edited(fp8_dir, tmp_path / "kv", quantization, kv)
    engine = engine_for(path, kernel_backend, kv_cache_dtype="fp8")
    assert engine.runner.model.kv_scales == scales
    prompts = random_prompts([7, 26, 11], engine.model_config.vocab_size, seed=6)
    hf = hf_model(fp32_dir, scales, kind="fp8")
    got = engine.generate(prompts, max_new_tokens=MAX_NEW, end_id=engine.model_config.eos_token_id)
    assert got == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    plain = engine_for(path, kernel_backend)
    assert plain.runner.model.kv_scales is None
    assert plain.generate(prompts, max_new_tokens=MAX_NEW, end_id=plain.model_config.eos_token_id) != got, \
        "the rounding changes some token here: the check can tell"


def test_kv_scales_in_some_layers_only_are_refused_by_name(checkpoints, tmp_path):
    path = edited(checkpoints["fp8 blocks"][0], tmp_path / "kv", None,
                  {"model.layers.0.self_attn.k_scale": torch.tensor([2.0]),
                   "model.layers.0.self_attn.v_scale": torch.tensor([2.0])})
    with pytest.raises(ValueError, match=r"tensors this server does not read: model.layers.0.self_attn.k_scale, "
                                         r"model.layers.0.self_attn.v_scale"):
        engine_for(path, "torch", kv_cache_dtype="fp8")

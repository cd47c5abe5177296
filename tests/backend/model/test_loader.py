"""The weights loader: sharded checkpoints, fusion, tensor-parallel slices, and errors that name the culprit."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import LLMEngine
from backend.model.checkpoint import ModelConfig
from backend.model.loader import load_weights
from tests.helpers import random_prompts


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_the_same_weights(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg = ModelConfig.from_dir(tiny_model_dir)
    single = load_weights(tiny_model_dir, cfg, torch.float32)
    sharded = load_weights(tmp_path, cfg, torch.float32)
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_fused_projections_concatenate_the_checkpoint_tensors(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    raw = load_file(tiny_model_dir / "model.safetensors")
    w = load_weights(tiny_model_dir, cfg, torch.float32)
    p = "model.layers.1"
    assert torch.equal(w["layers.1.qkv_proj"], torch.cat([raw[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"]))
    assert torch.equal(w["layers.1.gate_up_proj"],
                       torch.cat([raw[f"{p}.mlp.gate_proj.weight"], raw[f"{p}.mlp.up_proj.weight"]]))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_slices_reassemble_the_full_weights(tiny_model_dir, tp_size):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    full = load_weights(tiny_model_dir, cfg, torch.float32)
    ranks = [load_weights(tiny_model_dir, cfg, torch.float32, tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    shard = cfg.shard(tp_size)
    parts = [r["layers.0.qkv_proj"].split([shard.q_size, shard.kv_size, shard.kv_size]) for r in ranks]
    full_q, full_k, full_v = full["layers.0.qkv_proj"].split([cfg.q_size, cfg.kv_size, cfg.kv_size])
    assert torch.equal(torch.cat([p[0] for p in parts]), full_q)        # q by heads
    for rank, p in enumerate(parts):                                    # k, v by KV heads (2 heads: 4 ranks share)
        num_parts, index, _ = cfg.kv_head_part(tp_size, rank)
        assert torch.equal(p[1], full_k.chunk(num_parts)[index]) and torch.equal(p[2], full_v.chunk(num_parts)[index])
    assert torch.equal(torch.cat([r["layers.0.o_proj"] for r in ranks], dim=1), full["layers.0.o_proj"])
    assert torch.equal(torch.cat([r["layers.0.down_proj"] for r in ranks], dim=1), full["layers.0.down_proj"])
    assert torch.equal(ranks[1]["embed_tokens"], full["embed_tokens"])


def test_a_tensor_parallel_worker_loads_no_lm_head(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    share = load_weights(tiny_model_dir, cfg, torch.float32, tp_size=2, tp_rank=1)
    worker = load_weights(tiny_model_dir, cfg, torch.float32, tp_size=2, tp_rank=1, lm_head=False)
    assert set(share) - set(worker) == {"lm_head"}
    assert all(torch.equal(worker[name], share[name]) for name in worker)


def test_tied_embeddings_reuse_the_embedding_matrix(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir, tmp_path / "tied")
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    w = load_weights(path, ModelConfig.from_dir(path), torch.float32)
    assert torch.equal(w["lm_head"], w["embed_tokens"])


def test_missing_key_is_named(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir, tmp_path / "missing")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        LLMEngine(path, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)


def test_unexpected_shape_is_named(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir, tmp_path / "shape")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError,
                       match=r"model.layers.0.self_attn.k_proj.weight has shape \[8, 64\], expected \[32, 64\]"):
        LLMEngine(path, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)


def test_unsupported_architecture_is_named(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir, tmp_path / "arch")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLMEngine(path, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)


def test_llama3_rope_scaling_matches_hf(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    from tests.helpers import hf_greedy
    path = copy_model(tiny_model_dir, tmp_path / "llama3")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}
    config.pop("rope_scaling", None)
    (path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(path, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    prompts = random_prompts([90, 12], engine.model_config.vocab_size, seed=11)
    eos = engine.model_config.eos_token_id
    assert engine.generate(prompts, max_new_tokens=8, end_id=eos) == [hf_greedy(hf, p, 8) for p in prompts]


def edited_model(tiny_model_dir, path, config: dict | None = None, tensors: dict | None = None):
    """The tiny model with config.json fields set (None: removed) and checkpoint tensors added."""
    copy_model(tiny_model_dir, path)
    fields = json.loads((path / "config.json").read_text())
    for name, value in (config or {}).items():
        fields.pop(name, None) if value is None else fields.__setitem__(name, value)
    (path / "config.json").write_text(json.dumps(fields))
    if tensors:
        weights = load_file(path / "model.safetensors")
        save_file(weights | tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


# Fields and tensors that change the math and that the loader does not read: each refused at start, by name.
UNREAD = {
    "bitsandbytes": ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, {},
                     "quantization_config: quant_method 'bitsandbytes' is not read; read: fp8"),
    "a scale beside an unquantized weight": (
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
        {"model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(1, 1)},
        "does not read: model.layers.0.mlp.down_proj.weight_scale_inv"),
    "attention_bias": ({"attention_bias": True}, {}, "attention_bias: true"),
    "mlp_bias": ({"mlp_bias": True}, {}, "mlp_bias: true"),
    "activation": ({"hidden_act": "relu"}, {}, "hidden_act 'relu' is not supported"),
    "pretraining_tp": ({"pretraining_tp": 2}, {}, "pretraining_tp 2"),
    "layer type": ({"layer_types": ["full_attention", "chunked_attention"]}, {}, "chunked_attention"),
    "a bias tensor": ({}, {"model.layers.1.self_attn.o_proj.bias": torch.zeros(64)},
                      "does not read: model.layers.1.self_attn.o_proj.bias"),
    "GPTQ tensors": ({}, {f"model.layers.0.mlp.up_proj.{name}": torch.zeros(2, 2, dtype=torch.int32)
                          for name in ("qweight", "qzeros", "scales", "g_idx")},
                     "model.layers.0.mlp.up_proj.g_idx, model.layers.0.mlp.up_proj.qweight, "
                     "model.layers.0.mlp.up_proj.qzeros and 1 more"),
}


@pytest.mark.parametrize("case", sorted(UNREAD))
def test_a_field_or_tensor_the_loader_does_not_read_is_refused_by_name(tiny_model_dir, tmp_path, case):
    config, tensors, message = UNREAD[case]
    path = edited_model(tiny_model_dir, tmp_path / "edited", config, tensors)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        LLMEngine(path, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)


@pytest.mark.parametrize("arch,config", [
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),   # layer 1 slides only
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})])
def test_fields_that_change_the_math_are_read_and_used(tmp_path, arch, config):
    from transformers import AutoModelForCausalLM
    from tests.helpers import build_tiny, hf_greedy
    build_tiny(tmp_path, seed=5, architecture=arch, **config)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    engine = LLMEngine(tmp_path, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    if "max_window_layers" in config:
        assert [engine.model_config.window(i) for i in range(2)] == [None, 8]
    prompts = random_prompts([30, 12], engine.model_config.vocab_size, seed=12)
    eos = engine.model_config.eos_token_id
    assert engine.generate(prompts, max_new_tokens=8, end_id=eos) == [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.parametrize("tp_size,tp_rank", [(1, 0), (2, 1)])
def test_a_mixtures_stacked_experts_load_as_its_experts_one_by_one(tmp_path, tp_size, tp_rank):
    """transformers 5's stacked form (mlp.experts.gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]),
    written here from the per-expert checkpoint save_pretrained writes: the same weights, whole and on a rank."""
    from scripts.prepare_model import build_tiny
    build_tiny(tmp_path / "per_expert", seed=5, architecture="qwen3_moe")
    cfg = ModelConfig.from_dir(tmp_path / "per_expert")
    tensors = load_file(tmp_path / "per_expert" / "model.safetensors")
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.0.gate_proj.weight" in tensors:
            experts = range(cfg.num_experts)
            stacked[f"{p}.gate_up_proj"] = torch.stack([
                torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]) for e in experts])
            stacked[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in experts])
    (tmp_path / "stacked").mkdir()
    shutil.copy(tmp_path / "per_expert" / "config.json", tmp_path / "stacked")
    save_file(stacked, tmp_path / "stacked" / "model.safetensors")
    one_by_one = load_weights(tmp_path / "per_expert", cfg, torch.float32, tp_size=tp_size, tp_rank=tp_rank)
    from_stacked = load_weights(tmp_path / "stacked", cfg, torch.float32, tp_size=tp_size, tp_rank=tp_rank)
    assert one_by_one.keys() == from_stacked.keys() and "layers.1.experts_gate_up" in one_by_one
    assert all(torch.equal(one_by_one[k], from_stacked[k]) for k in one_by_one)
    assert one_by_one["layers.1.experts_gate_up"].shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size // tp_size,
                                                            cfg.hidden_size)


def test_a_bf16_checkpoint_served_in_fp32_keeps_its_projections_in_bf16(tiny_model_dir, tmp_path):
    """dtype float32 (what auto picks on a CPU without bf16 arithmetic) over a bf16 checkpoint: the compiled CPU
    backend keeps the projections and LM head in bf16 panels, half fp32's bytes, and its greedy tokens are
    transformers' in fp32 on that checkpoint."""
    from transformers import AutoModelForCausalLM
    from tests.helpers import cpu_kernels_build, hf_greedy
    if not cpu_kernels_build():
        pytest.skip("the compiled CPU kernels did not build")
    copy_model(tiny_model_dir, tmp_path / "bf16")
    path = tmp_path / "bf16" / "model.safetensors"
    save_file({key: t.to(torch.bfloat16) for key, t in load_file(path).items()}, path, metadata={"format": "pt"})
    engine = LLMEngine(tmp_path / "bf16", dtype="float32", kernel_backend="cpu", kv_cache_memory_bytes=1 << 20)
    full = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="cpu", kv_cache_memory_bytes=1 << 20)
    weights = engine.runner.model.w
    panels = [name for name, w in weights.items() if name.endswith("_proj") or name == "lm_head"]
    assert all(weights[name].dtype == torch.bfloat16 and weights[name].dim() == 3 for name in panels)
    saved = sum(weights[name].numel() * 2 for name in panels)
    assert engine.runner.weight_bytes == full.runner.weight_bytes - saved
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    prompts = random_prompts([5, 21, 9, 33], engine.model_config.vocab_size, seed=4)
    assert engine.generate(prompts, max_new_tokens=8) == [hf_greedy(hf, p, 8) for p in prompts]


def test_each_weight_is_prepared_as_it_is_read_not_after_the_whole_model(tiny_model_dir):
    """load_weights' prepare (the kernels' layout: ops.prepare_weight) takes each weight as soon as it is read, and
    the weight as read is dropped then: at no point are more than the last two read weights alive (a model read
    whole before its weights are prepared, a bf16 checkpoint served in fp32 would lie in memory in fp32)."""
    import weakref
    cfg = ModelConfig.from_dir(tiny_model_dir)
    read, most_alive = [], 0

    def prepare(name, weight):
        nonlocal most_alive
        most_alive = max(most_alive, sum(ref() is not None for ref in read))
        read.append(weakref.ref(weight))
        return weight.to(torch.bfloat16)

    weights = load_weights(tiny_model_dir, cfg, torch.float32, prepare=prepare)
    assert len(read) == len(weights) and all(w.dtype == torch.bfloat16 for w in weights.values())
    assert most_alive <= 2
    assert sum(ref() is not None for ref in read) <= 1

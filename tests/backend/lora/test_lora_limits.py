"""The adapter caches' auto sizes, from the served model's config alone (no weights): a rank-64 all-module adapter
of Llama-3.1-8B (335 MB in bf16) fits by default, which the fixed 256 MiB once refused; explicit sizes keep working;
a host tier too small for one adapter refuses to start, naming both settings."""
import pytest
import torch

from backend.config import LoraCacheConfig
from backend.config import split_engine_kwargs
from backend.lora import limits
from backend.lora.format import MODULE_NAMES, check_lora, module_shape
from backend.model.checkpoint import ModelConfig

LLAMA_8B = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                                "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5})


def all_modules_at(cfg: ModelConfig, rank: int, dora: bool = False):
    """lora_weights (values never read: a zero broadcast) and lora_config of an adapter at `rank` on q, k, v, o,
    gate, up and down of every layer (DoRA on each: a magnitude too)."""
    config = torch.tensor([[m, layer, rank] + [1] * dora for layer in range(cfg.num_layers)
                           for m in (1, 2, 3, 4, 5, 6, 7)], dtype=torch.int32)
    width = max(rank * sum(module_shape(cfg, m)) + dora * module_shape(cfg, m)[1] for m in MODULE_NAMES if m)
    return torch.zeros((), dtype=torch.bfloat16).expand(len(config), width), config


def test_an_8b_rank_64_adapter_fits_the_default_sizes(monkeypatch):
    monkeypatch.setattr(limits, "machine_memory_bytes", lambda: 128 << 30)        # an H200 machine's
    cfg = limits.resolve_limits(LoraCacheConfig(max_loras=16), LLAMA_8B, torch.bfloat16)
    assert cfg.max_adapter_bytes == 338_296_832            # A and B at rank 64 (335,544,320) and DoRA magnitudes
    for dora in (False, True):
        weights, config = all_modules_at(LLAMA_8B, 64, dora)
        check_lora(weights, config, LLAMA_8B, torch.bfloat16, cfg.max_lora_rank, cfg.max_adapter_bytes)
    assert cfg.host_memory_bytes == 2 * 16 * 338_296_832                           # W1's 16 adapters, twice over
    with pytest.raises(Exception, match="exceeds lora_cache_max_adapter_size"):     # the old fixed default
        check_lora(weights, config, LLAMA_8B, torch.bfloat16, 64, 256 << 20)


def test_explicit_sizes_keep_working_under_tensorrt_llm_names():
    _, lora = split_engine_kwargs({"lora_cache_host_memory_bytes": 5 << 30, "lora_cache_max_adapter_size": 300 << 20,
                                   "max_lora_rank": 64})
    cfg = limits.resolve_limits(LoraCacheConfig(**lora), LLAMA_8B, torch.bfloat16)
    assert (cfg.host_memory_bytes, cfg.max_adapter_bytes) == (5 << 30, 300 << 20)


def test_the_auto_host_tier_is_at_least_a_gib_and_at_most_a_share_of_memory(monkeypatch):
    small = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5})
    monkeypatch.setattr(limits, "machine_memory_bytes", lambda: 64 << 30)
    assert limits.resolve_limits(LoraCacheConfig(), small, torch.float16).host_memory_bytes == 1 << 30
    monkeypatch.setattr(limits, "machine_memory_bytes", lambda: 8 << 30)
    assert limits.resolve_limits(LoraCacheConfig(max_loras=16), LLAMA_8B, torch.bfloat16).host_memory_bytes == 2 << 30


@pytest.mark.parametrize("settings, words", [
    (dict(host_memory_bytes=100 << 20), "lora_cache_host_memory_bytes 104857600 cannot hold one adapter of "
                                        "lora_cache_max_adapter_size 338296832"),
    (dict(), "25% of this machine's memory")])
def test_a_host_tier_that_cannot_hold_one_adapter_refuses_to_start(monkeypatch, settings, words):
    monkeypatch.setattr(limits, "machine_memory_bytes", lambda: 1 << 30)            # a quarter: 256 MiB
    with pytest.raises(ValueError, match=words):
        limits.resolve_limits(LoraCacheConfig(**settings), LLAMA_8B, torch.bfloat16)


def test_auto_is_the_only_word_a_size_takes():
    with pytest.raises(ValueError, match="host_memory_bytes must be >= 1 or auto"):
        LoraCacheConfig(host_memory_bytes="lots")

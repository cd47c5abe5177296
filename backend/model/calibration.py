"""The tokens an INT8 KV cache's scales are calibrated on at start: a fixed text of plain prose, a dialogue, numbers
and a little code (calibration.txt, ours), in the model's tokenizer; the same every start whatever the requests,
so that no request's tokens depend on another's. A model directory without a tokenizer gets fixed token ids. And
the largest magnitudes a calibration prefill wrote (each rank's, under tensor parallelism, reduced to the layer's)."""
from pathlib import Path

import torch

TEXT = Path(__file__).with_name("calibration.txt")
NUM_FALLBACK_TOKENS = 256


def calibration_ids(model_dir: str, vocab_size: int, max_tokens: int) -> list[int]:
    """The calibration text's token ids in the model's tokenizer (at most max_tokens), or, where the directory has
    no tokenizer, NUM_FALLBACK_TOKENS ids spread over the vocabulary."""
    path = Path(model_dir)
    if (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file():
        from backend.text import tokenizer_from_dir
        ids = tokenizer_from_dir(path)(TEXT.read_text())["input_ids"]
        return [i for i in ids if 0 <= i < vocab_size][:max_tokens]
    return [(i * 7919 + 13) % vocab_size for i in range(min(NUM_FALLBACK_TOKENS, max_tokens))]


def kv_amax(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_tokens: int) -> torch.Tensor:
    """[num_layers, 2] fp32 (CPU): each layer's largest |K| and |V| over the first num_tokens slots (a calibration
    prefill of one sequence from block 0 on), this rank's KV heads."""
    return torch.tensor([[cache.flatten(1, 2)[:, :num_tokens].float().abs().max().item() for cache in pair]
                         for pair in kv_caches], dtype=torch.float32)

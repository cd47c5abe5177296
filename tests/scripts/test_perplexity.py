"""scripts/perplexity.py's figure: exp of the mean negative log prob of each window's tokens given those before it,
as transformers scores the same windows."""
import math

import torch

from scripts.perplexity import perplexity
from tests.helpers import random_prompts


def test_the_perplexity_is_transformers_own_over_the_same_windows(tiny_model_dir, hf_tiny):
    ids = random_prompts([70], 512, seed=4)[0]                   # windows of 32, 32 and 6 tokens
    value, count = perplexity(str(tiny_model_dir), ids, 32, dtype="float32", kernel_backend="torch",
                              kv_cache_memory_bytes=1 << 20)
    total, scored = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids), 32):
            window = ids[start:start + 32]
            log_probs = hf_tiny(torch.tensor([window])).logits[0].float().log_softmax(-1)
            total += float(log_probs[torch.arange(len(window) - 1), torch.tensor(window[1:])].sum())
            scored += len(window) - 1
    assert count == scored == 67
    assert math.isclose(value, math.exp(-total / scored), rel_tol=1e-4)

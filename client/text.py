"""Text helpers shared by the text models (preprocessing, postprocessing, ensemble) and the CLI."""
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def tokenizer_dir(param: str = "") -> str:
    """LORA_LLM_TOKENIZER_DIR, else LORA_LLM_MODEL_DIR, else the model parameter (relative to the repo root)."""
    value = os.environ.get("LORA_LLM_TOKENIZER_DIR") or os.environ.get("LORA_LLM_MODEL_DIR") or param \
        or "models/smollm2-135m-instruct"
    return value if os.path.isabs(value) else str(ROOT / value)


def load_tokenizer(param: str = ""):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir(param))


def words_list(tokenizer, words: list[str]) -> np.ndarray:
    """TensorRT-LLM words list [2, L]: ids of all words back to back, then each word's end offset; -1 padded."""
    ids, offsets = [], []
    for word in words:
        ids += tokenizer(word, add_special_tokens=False)["input_ids"]
        offsets.append(len(ids))
    width = max(1, len(ids))
    out = np.full((2, width), -1, dtype=np.int32)
    out[0, :len(ids)] = ids
    out[1, :len(offsets)] = offsets
    return out


def decode_strings(array: np.ndarray) -> list[str]:
    return [x.decode() if isinstance(x, bytes) else str(x) for x in np.asarray(array).reshape(-1)]

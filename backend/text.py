"""Text around the token ids, shared by the server's text models and the client: the tokenizer, TensorRT-LLM
words lists, embedding bias from words, and incremental detokenization. Framework-free."""
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
    return tokenizer_from_dir(tokenizer_dir(param))


def tokenizer_from_dir(path: str | Path):
    """The model's tokenizer. A tokenizer.json loads as transformers' fast tokenizer directly: 0.7 s, where
    AutoTokenizer takes 3.4 s (it imports torch and the model configurations), in each of the four text models that
    load as tritonserver starts, and again at every restart."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


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


def embedding_bias(tokenizer, words: list[str], weights: list[float], vocab_size: int) -> np.ndarray:
    """[vocab] fp32: each word's weight added at every token id of the word (TensorRT-LLM's preprocessing)."""
    if len(words) != len(weights):
        raise ValueError(f"embedding_bias_words ({len(words)}) and embedding_bias_weights ({len(weights)}) "
                         "must have the same length")
    bias = np.zeros(vocab_size, dtype=np.float32)
    for word, weight in zip(words, weights):
        for token_id in tokenizer(word, add_special_tokens=False)["input_ids"]:
            bias[token_id] += weight
    return bias


def decode_strings(array: np.ndarray) -> list[str]:
    return [x.decode() if isinstance(x, bytes) else str(x) for x in np.asarray(array).reshape(-1)]


class IncrementalDetokenizer:
    """Text pieces as tokens arrive, never splitting a multi-byte character: tokenizers' own DecodeStream, so
    each token costs the same however long the sequence is."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream
        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.emitted = ""

    def add(self, token_ids: list[int]) -> str:
        """The new text these tokens complete (empty while a character is still partial)."""
        pieces = [self.stream.step(self.backend, int(t)) for t in token_ids]
        piece = "".join(p for p in pieces if p)
        self.emitted += piece
        return piece

"""Text -> token ids, stop/bad words lists, end and pad ids, for lora_llm; a batch of B prompts becomes
input_ids [B, longest] padded with the pad id, and words lists [B, 2, widest] padded with -1."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from backend.processes import end_stub                               # noqa: E402
from backend.text import decode_strings, load_tokenizer, words_list  # noqa: E402


def padded(rows: list[np.ndarray], value: int) -> np.ndarray:
    """Arrays of the same rank, padded along their last dim to the widest and stacked."""
    width = max(r.shape[-1] for r in rows)
    return np.stack([np.pad(r, [(0, 0)] * (r.ndim - 1) + [(0, width - r.shape[-1])], constant_values=value)
                     for r in rows])


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tokenizer = load_tokenizer(params["tokenizer_dir"]["string_value"])
        pad_id = self.tokenizer.pad_token_id
        self.pad_id = pad_id if pad_id is not None else self.tokenizer.eos_token_id

    def _optional(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        texts = decode_strings(self._optional(request, "QUERY"))
        batch = len(texts)
        end_id, pad_id = (self._optional(request, name) for name in ("END_ID", "PAD_ID"))
        end_ids = [self.tokenizer.eos_token_id] * batch if end_id is None else end_id.reshape(-1).tolist()
        pad_ids = [self.pad_id] * batch if pad_id is None else pad_id.reshape(-1).tolist()
        ids = [np.array(self.tokenizer(text)["input_ids"], dtype=np.int32) for text in texts]
        words = {}
        for name in ("BAD_WORDS_DICT", "STOP_WORDS_DICT"):
            value = self._optional(request, name)
            rows = [[]] * batch if value is None else [decode_strings(row) for row in value.reshape(batch, -1)]
            words[name] = padded([words_list(self.tokenizer, [w for w in row if w]) for row in rows], -1)
        outputs = {
            "INPUT_ID": padded(ids, pad_ids[0]),
            "REQUEST_INPUT_LEN": np.array([[len(i)] for i in ids], dtype=np.int32),
            "BAD_WORDS_IDS": words["BAD_WORDS_DICT"],
            "STOP_WORDS_IDS": words["STOP_WORDS_DICT"],
            "REQUEST_OUTPUT_LEN": self._optional(request, "REQUEST_OUTPUT_LEN").astype(np.int32).reshape(batch, 1),
            "OUT_END_ID": np.array(end_ids, np.int32).reshape(batch, 1),
            "OUT_PAD_ID": np.array(pad_ids, np.int32).reshape(batch, 1),
        }
        return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()])

    def finalize(self):
        end_stub()

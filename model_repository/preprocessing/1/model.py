"""Text -> token ids, stop/bad words lists, end and pad ids, for lora_llm."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from backend.text import decode_strings, load_tokenizer, words_list   # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tokenizer = load_tokenizer(params["tokenizer_dir"]["string_value"])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id

    def _optional(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def execute(self, requests):
        responses = []
        for request in requests:
            [text] = decode_strings(self._optional(request, "QUERY"))
            ids = self.tokenizer(text)["input_ids"]
            bad, stop = (self._optional(request, name) for name in ("BAD_WORDS_DICT", "STOP_WORDS_DICT"))
            end_id, pad_id = (self._optional(request, name) for name in ("END_ID", "PAD_ID"))
            outputs = {
                "INPUT_ID": np.array([ids], dtype=np.int32),
                "REQUEST_INPUT_LEN": np.array([[len(ids)]], dtype=np.int32),
                "BAD_WORDS_IDS": words_list(self.tokenizer, [] if bad is None else decode_strings(bad))[None],
                "STOP_WORDS_IDS": words_list(self.tokenizer, [] if stop is None else decode_strings(stop))[None],
                "REQUEST_OUTPUT_LEN": self._optional(request, "REQUEST_OUTPUT_LEN").astype(np.int32).reshape(1, 1),
                "OUT_END_ID": np.array([[self.tokenizer.eos_token_id if end_id is None else end_id.item()]], np.int32),
                "OUT_PAD_ID": np.array([[self.pad_id if pad_id is None else pad_id.item()]], np.int32),
            }
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
        return responses

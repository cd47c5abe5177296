"""Token ids [batch, beam, tokens] -> text [batch, beam], special tokens skipped."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from backend.processes import end_stub   # noqa: E402
from backend.text import load_tokenizer  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tokenizer = load_tokenizer(params["tokenizer_dir"]["string_value"])

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()   # [batch, beam, n]
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH")
            lengths = lengths.as_numpy() if lengths is not None else np.full(tokens.shape[:2], tokens.shape[2])
            texts = [[self.tokenizer.decode(tokens[b, k, :lengths[b, k]], skip_special_tokens=True).encode()
                      for k in range(tokens.shape[1])] for b in range(tokens.shape[0])]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.array(texts, dtype=object))]))
        return responses

    def finalize(self):
        end_stub()

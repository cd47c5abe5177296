"""text_input -> preprocessing -> lora_llm (streamed) -> text_output, detokenized incrementally per stream."""
import json
import sys
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from client.detokenize import IncrementalDetokenizer   # noqa: E402
from client.text import load_tokenizer                 # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# ensemble input -> lora_llm input, passed through as they are
PASS_THROUGH = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "temperature": "temperature",
                "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                "frequency_penalty": "frequency_penalty", "min_length": "min_tokens", "random_seed": "seed",
                "return_log_probs": "return_log_probs", "beam_width": "beam_width", "stream": "streaming",
                "exclude_input_in_output": "exclude_input_in_output", "lora_task_id": "lora_task_id",
                "lora_weights": "lora_weights", "lora_config": "lora_config"}
PREPROCESS = {"text_input": "QUERY", "max_tokens": "REQUEST_OUTPUT_LEN", "bad_words": "BAD_WORDS_DICT",
              "stop_words": "STOP_WORDS_DICT", "end_id": "END_ID", "pad_id": "PAD_ID"}
FROM_PREPROCESS = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths", "REQUEST_OUTPUT_LEN":
                   "request_output_len", "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id",
                   "BAD_WORDS_IDS": "bad_words_list", "STOP_WORDS_IDS": "stop_words_list"}


def tensor(name: str, array) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.asarray(array))


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tokenizer = load_tokenizer(params["tokenizer_dir"]["string_value"])

    def execute(self, requests):
        for request in requests:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            sender = request.get_response_sender()
            threading.Thread(target=self._serve, args=(inputs, sender), daemon=True).start()
        return None

    def _serve(self, inputs: dict, sender) -> None:
        try:
            self._generate(inputs, sender)
        except Exception as err:                            # answer, never leave the stream open
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"ensemble: {err}")), flags=FINAL)

    def _generate(self, inputs: dict, sender) -> None:
        pre = pb_utils.InferenceRequest(
            model_name="preprocessing", requested_output_names=list(FROM_PREPROCESS),
            inputs=[tensor(PREPROCESS[k], v) for k, v in inputs.items() if k in PREPROCESS]).exec()
        if pre.has_error():
            raise RuntimeError(pre.error().message())
        llm_inputs = [tensor(FROM_PREPROCESS[t.name()], t.as_numpy()) for t in pre.output_tensors()
                      if t.name() in FROM_PREPROCESS and not (t.name().endswith("WORDS_IDS") and
                                                               (t.as_numpy()[..., 1, :] < 0).all())]
        llm_inputs += [tensor(PASS_THROUGH[k], v) for k, v in inputs.items() if k in PASS_THROUGH]
        streaming = bool(inputs["stream"].item()) if "stream" in inputs else False
        detok = IncrementalDetokenizer(self.tokenizer)
        llm = pb_utils.InferenceRequest(model_name="lora_llm", requested_output_names=["output_ids"],
                                        inputs=llm_inputs)
        for response in llm.exec(decoupled=True):
            if response.has_error():
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(response.error().message())),
                            flags=FINAL)
                return
            ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
            tokens = [] if ids is None else ids.as_numpy().reshape(-1).tolist()
            piece = detok.add(tokens)
            if streaming and piece:
                sender.send(pb_utils.InferenceResponse([tensor("text_output", np.array([[piece.encode()]], object))]))
        rest = detok.flush() if streaming else detok.emitted + detok.flush()
        sender.send(pb_utils.InferenceResponse([tensor("text_output", np.array([[rest.encode()]], object))]),
                    flags=FINAL)

"""text_input -> preprocessing -> the core model (streamed) -> text_output, detokenized incrementally per
sequence. Serves tensorrtllm_backend's text models, `ensemble` and `tensorrt_llm_bls`, decoupled or not.
A client's cancellation does not reach a BLS call in Triton 2.51, so a watcher sends the core a `stop`."""
import json
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from backend.core.request import RequestError                                                      # noqa: E402
from backend.processes import end_stub                                                             # noqa: E402
from backend.serving.contract import TEXT_UNSUPPORTED, check_unsupported                           # noqa: E402
from backend.text import (IncrementalDetokenizer, decode_strings, embedding_bias, load_tokenizer,  # noqa: E402
                          tokenizer_dir)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# text model input -> core model input, passed through as they are
TO_CORE = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "temperature": "temperature",
           "length_penalty": "len_penalty", "early_stopping": "early_stopping",
           "repetition_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "min_length": "min_tokens",
           "random_seed": "seed", "beam_width": "beam_width", "stream": "streaming",
           "exclude_input_in_output": "exclude_input_in_output", "num_return_sequences": "num_return_sequences",
           "lora_task_id": "lora_task_id", "lora_weights": "lora_weights", "lora_config": "lora_config",
           "prompt_embedding_table": "prompt_embedding_table", "prompt_vocab_size": "prompt_vocab_size",
           "guided_decoding_guide_type": "guided_decoding_guide_type",
           "guided_decoding_guide": "guided_decoding_guide"} | {
    name: name for name in ("return_log_probs", "return_context_logits", "return_generation_logits",
                            "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens")}
PREPROCESS = {"text_input": "QUERY", "max_tokens": "REQUEST_OUTPUT_LEN", "bad_words": "BAD_WORDS_DICT",
              "stop_words": "STOP_WORDS_DICT", "end_id": "END_ID", "pad_id": "PAD_ID"}
FROM_PREPROCESS = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths", "REQUEST_OUTPUT_LEN":
                   "request_output_len", "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id",
                   "BAD_WORDS_IDS": "bad_words_list", "STOP_WORDS_IDS": "stop_words_list"}
# core outputs handed on with the text
PASSED_OUTPUTS = ("cum_log_probs", "output_log_probs", "batch_index", "sequence_index", "kv_cache_alloc_new_blocks",
                  "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns",
                  "first_token_time_ns", "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens",
                  "total_draft_tokens", "num_input_tokens", "num_output_tokens")


def tensor(name: str, array) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.asarray(array))


class CancelWatcher:
    """Polls the senders of the requests in flight; when a client cancels one, sends the core model a `stop`
    with the request id the core request was given. A sender is never touched after its final response."""

    INTERVAL_S = 0.2

    def __init__(self, core: str, decoupled: bool):
        self.core, self.decoupled = core, decoupled
        self.lock = threading.Lock()
        self.watched: dict[str, object] = {}                  # core request id -> sender
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def watch(self, core_id: str, sender) -> None:
        with self.lock:
            self.watched[core_id] = sender

    def unwatch(self, core_id: str) -> None:
        """Called before the final response is sent."""
        with self.lock:
            self.watched.pop(core_id, None)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopped.wait(self.INTERVAL_S):
            with self.lock:
                cancelled = [i for i, sender in self.watched.items() if sender.is_cancelled()]
                for core_id in cancelled:
                    del self.watched[core_id]
            for core_id in cancelled:
                self._stop(core_id)

    def _stop(self, core_id: str) -> None:
        """TensorRT-LLM's stop request: the id and `stop`, with placeholders for the required inputs."""
        inputs = [tensor("input_ids", np.zeros((1, 1), np.int32)), tensor("input_lengths", np.ones((1, 1), np.int32)),
                  tensor("request_output_len", np.ones((1, 1), np.int32)), tensor("stop", np.ones((1, 1), bool))]
        request = pb_utils.InferenceRequest(model_name=self.core, request_id=core_id, inputs=inputs,
                                            requested_output_names=["output_ids"])
        try:
            for _ in request.exec(decoupled=True) if self.decoupled else [request.exec()]:
                pass
        except Exception as err:                            # the core may have finished meanwhile
            pb_utils.Logger.log_warn(f"stopping {core_id}: {err}")


def index(arrays: dict, name: str) -> int:
    return int(arrays[name].reshape(-1)[0]) if name in arrays else 0


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])
        self.core = params.get("tensorrt_llm_model_name") or "lora_llm"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.watcher = CancelWatcher(self.core, self.decoupled)
        model_config = Path(tokenizer_dir(params["tokenizer_dir"])) / "config.json"
        self.vocab_size = json.loads(model_config.read_text())["vocab_size"] if model_config.exists() \
            else len(self.tokenizer)

    def execute(self, requests):
        for request in requests:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            sender = request.get_response_sender()
            threading.Thread(target=self._serve, args=(inputs, sender), daemon=True).start()
        return None

    def _serve(self, inputs: dict, sender) -> None:
        core_id = f"text-{uuid.uuid4().hex}"
        try:
            self._generate(inputs, sender, core_id)
        except Exception as err:                            # answer, never leave the stream open
            self.watcher.unwatch(core_id)
            message = str(err) if isinstance(err, RequestError) else f"{type(err).__name__}: {err}"
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)

    def _generate(self, inputs: dict, sender, core_id: str) -> None:
        streaming = bool(inputs["stream"].any()) if "stream" in inputs else False
        if streaming and not self.decoupled:
            raise RequestError("stream", "streaming is only supported in decoupled mode")
        llm = pb_utils.InferenceRequest(model_name=self.core, inputs=self._core_inputs(inputs), request_id=core_id,
                                        requested_output_names=["output_ids", "sequence_length", *PASSED_OUTPUTS])
        self.watcher.watch(core_id, sender)
        detokenizers: dict[tuple[int, int], IncrementalDetokenizer] = {}
        last = None
        for response in llm.exec(decoupled=True) if self.decoupled else [llm.exec()]:
            if response.has_error():
                raise RuntimeError(response.error().message())
            arrays = {t.name(): t.as_numpy() for t in response.output_tensors()}
            ids = arrays.pop("output_ids", None)
            if ids is None:
                continue
            lengths = arrays.pop("sequence_length", None)
            if ids.shape[1] > 1:                             # beams: each one's whole text (beams change as they go)
                texts = [self.tokenizer.decode(ids[0, b, :lengths[0, b]], skip_special_tokens=True).encode()
                         for b in range(ids.shape[1])]
            else:
                key = (index(arrays, "batch_index"), index(arrays, "sequence_index"))
                detok = detokenizers.setdefault(key, IncrementalDetokenizer(self.tokenizer))
                texts = [detok.add(ids.reshape(-1).tolist()).encode()]
                if streaming and not texts[0]:
                    continue                                 # a character still partial
            last = pb_utils.InferenceResponse([tensor("text_output", np.array(texts, dtype=object))] +
                                              [tensor(name, value) for name, value in arrays.items()])
            if self.decoupled:
                sender.send(last)
        self.watcher.unwatch(core_id)
        if self.decoupled:
            sender.send(flags=FINAL)
        else:
            sender.send(last, flags=FINAL)

    def finalize(self):
        self.watcher.stop()
        end_stub()

    def _core_inputs(self, inputs: dict) -> list:
        check_unsupported(inputs, TEXT_UNSUPPORTED)
        pre = pb_utils.InferenceRequest(
            model_name="preprocessing", requested_output_names=list(FROM_PREPROCESS),
            inputs=[tensor(PREPROCESS[k], v) for k, v in inputs.items() if k in PREPROCESS]).exec()
        if pre.has_error():
            raise RuntimeError(pre.error().message())
        core = [tensor(FROM_PREPROCESS[t.name()], t.as_numpy()) for t in pre.output_tensors()
                if t.name() in FROM_PREPROCESS and not (t.name().endswith("WORDS_IDS") and
                                                         (t.as_numpy()[..., 1, :] < 0).all())]
        core += [tensor(TO_CORE[k], v) for k, v in inputs.items() if k in TO_CORE]
        if ("embedding_bias_words" in inputs) != ("embedding_bias_weights" in inputs):
            raise RequestError("embedding_bias_words", "embedding_bias_words and embedding_bias_weights must be "
                                                       "sent together")
        if "embedding_bias_words" in inputs:
            words, weights = inputs["embedding_bias_words"], inputs["embedding_bias_weights"]
            core.append(tensor("embedding_bias", np.stack([
                embedding_bias(self.tokenizer, decode_strings(w), np.asarray(x).reshape(-1).tolist(),
                               self.vocab_size) for w, x in zip(words, weights)])))
        return core

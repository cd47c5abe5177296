"""Triton Python backend adapter for the engine: tensors in, backend requests out, responses back.

No scheduling, model math or LoRA parsing here: `execute` parses and sends each request to the engine's process
(backend/engine_process.py, started by the instance's first stub and kept when a stub dies), then returns at once;
its answers come back on the client's answering thread (backend/engine_client.py) through each request's sender.
"""
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from backend.engine_client import EngineClient                 # noqa: E402
from backend.engine_process import RESTARTS_PARAMETER          # noqa: E402
from backend.heartbeat import Heartbeat, end_stub, watchdog     # noqa: E402
from backend.metrics import ServerMetrics                       # noqa: E402
from backend.output_arrays import (beam_arrays, extra_arrays, first_arrays, generation_logits,   # noqa: E402
                                   merge_rows, output_arrays, top_arrays)
from backend.protocol import check_declared, parse_request     # noqa: E402
from backend.request import RequestError                       # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
INT_PARAMS = ("kv_cache_memory_bytes", "kv_block_size", "max_num_seqs", "max_num_batched_tokens", "max_lora_rank",
              "max_loras", "lora_cache_host_memory_bytes", "lora_cache_max_adapter_size", "max_queue_size",
              "max_words", "max_word_len", "cancellation_check_period_ms", "responder_steps_behind",
              "tensor_parallel_size", "guided_decoding_compile_memory_bytes", "max_top_log_probs",
              "max_log_probs_per_request", "max_beam_width")
AUTO_PARAMS = ("lora_cache_host_memory_bytes", "lora_cache_max_adapter_size")    # or "auto"
FLOAT_PARAMS = ("kv_cache_free_gpu_mem_fraction", "guided_decoding_compile_timeout_s")
BOOL_PARAMS = ("enable_kv_cache_reuse", "cuda_graph_mode", "lora_overlap", "lora_fold")
INT_LIST_PARAMS = ("inject_fault_steps",)
PATH_PARAMS = ("model_dir", "lora_prefetch_dir", "tokenizer_dir")


def engine_kwargs(model_config: dict) -> dict:
    """Model parameters, each overridable by the environment variable LORA_LLM_<NAME>."""
    kwargs = {}
    for name, entry in model_config.get("parameters", {}).items():
        value = os.environ.get(f"LORA_LLM_{name.upper()}", entry["string_value"])
        if value == "" or name == RESTARTS_PARAMETER:
            continue
        if name in INT_PARAMS and not (name in AUTO_PARAMS and value == "auto"):
            value = int(value)
        elif name in FLOAT_PARAMS:
            value = float(value)
        elif name in BOOL_PARAMS:
            value = value.lower() in ("true", "1")
        elif name in INT_LIST_PARAMS:
            value = tuple(int(v) for v in value.split(","))
        elif name in PATH_PARAMS and not os.path.isabs(value):
            value = str(ROOT / value)
        kwargs[name] = value
    return kwargs


def as_array(tensor) -> np.ndarray:
    try:
        return tensor.as_numpy()
    except Exception:                              # BF16 has no numpy dtype: go through torch
        from torch.utils.dlpack import from_dlpack
        return from_dlpack(tensor.to_dlpack()).float().numpy()


class TritonStream:
    """One Triton request's response sender, for all its rows and sequences; never touched after its final
    response (the lock keeps a question from another thread off a final send in progress). Streaming rows answer
    each step's new tokens, the others each sequence's whole output."""

    def __init__(self, request, rows, metrics: ServerMetrics, unary: bool = False):
        self.requests = rows
        self.unary = unary                         # not decoupled: every row's output in one response
        self.held: dict[int, dict[str, np.ndarray]] = {}                          # unary rows done so far
        self.sender = request.get_response_sender()
        self.metrics = metrics
        self.start = time.perf_counter()
        self.outputs: dict[tuple[int, int], tuple[list, list, list, list]] = {}  # (batch, sequence) -> tokens, log
                                                                                  # probs, top ids, top log probs
        self.logits: dict[tuple[int, int], list[np.ndarray]] = {}                # generation logits, if asked
        self.first: dict[int, dict[str, np.ndarray]] = {}                        # batch index -> prompt outputs
        self.done = False
        self.lock = threading.Lock()

    def is_cancelled(self) -> bool:
        with self.lock:
            return not self.done and self.sender.is_cancelled()

    def emit(self, out, batch_index: int, last: bool) -> None:
        if self.done:
            return
        if not self.outputs:
            self.metrics.observe_ttft(time.perf_counter() - self.start)
        row = self.requests[batch_index]
        if out.beams is not None:
            self._emit_beams(out, row, batch_index, last)
            return
        tokens, log_probs, top_ids, top_log_probs = self.outputs.setdefault((batch_index, out.sequence_index),
                                                                            ([], [], [], []))
        tokens += out.new_token_ids
        log_probs += out.log_probs
        top_ids += out.top_ids
        top_log_probs += out.top_log_probs
        if out.sequence_index == 0 and (first := first_arrays(out)):
            self.first[batch_index] = first
        logits = self.logits.setdefault((batch_index, out.sequence_index), [])
        if out.generation_logits is not None:
            logits.append(out.generation_logits.numpy())
        first = self.first.pop(batch_index) if out.sequence_index == 0 and batch_index in self.first and \
            (row.streaming or out.finished) else {}
        if row.streaming and (out.new_token_ids or last):
            arrays = output_arrays(out.new_token_ids, out.log_probs) | first | top_arrays(out.top_ids,
                                                                                         out.top_log_probs, row)
            self._send(arrays | generation_logits(logits[-len(out.new_token_ids):] if out.new_token_ids else [],
                                                  row), last, row, batch_index, out, len(tokens))
        elif not row.streaming and out.finished:
            prompt = [] if row.exclude_input_in_output else row.prompt_ids
            arrays = output_arrays(prompt + tokens, [0.0] * len(prompt) + log_probs) | first
            self._send(arrays | top_arrays(top_ids, top_log_probs, row) | generation_logits(logits, row), last, row,
                       batch_index, out, len(tokens))
        if last:
            self.metrics.count("success")

    def _emit_beams(self, out, row, batch_index: int, last: bool) -> None:
        """A beam search's outputs: streaming, each round's beams so far (they change as beams take others'
        places); either way its best beams when it ends, with the prompt unless excluded, as TensorRT-LLM sends
        them."""
        self.outputs[(batch_index, 0)] = ([], [], [], [])          # (its first output counted for the TTFT)
        if row.streaming or out.request_finished:
            prompt = [] if row.streaming or row.exclude_input_in_output else row.prompt_ids
            num_tokens = len(out.beams[0].output_ids)
            pad = row.params.end_id if row.params.end_id is not None else 0
            self._send(beam_arrays(out.beams, prompt, pad), last, row, batch_index, out, num_tokens)
        if last:
            self.metrics.count("success")

    def fail(self, message: str) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
        self.metrics.count("failure")

    def acknowledge(self) -> None:
        """The final, empty response to a `stop` request."""
        self._send(output_arrays([], []), True)

    def cancelled(self) -> None:
        if not self.done:
            row = self.requests[0]
            tokens, log_probs, *_ = ([], []) if row.streaming else self.outputs.get((0, 0), ([], []))
            self._send(output_arrays(tokens, log_probs if tokens else []), True)
            self.metrics.count("cancelled")

    def _send(self, arrays: dict, final: bool, row=None, batch_index: int = 0, out=None, num_tokens: int = 0):
        if row is not None:
            arrays |= extra_arrays(row, len(self.requests), batch_index, out.sequence_index, out.metrics, num_tokens)
        if self.unary and len(self.requests) > 1:
            self.held[batch_index] = arrays
            if not final:
                return
            arrays = merge_rows([self.held[b] for b in sorted(self.held)])
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])
        with self.lock:
            self.done = final
            self.sender.send(response, flags=FINAL if final else 0)


def metric_family(name: str, description: str, kind: str):
    kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
             "histogram": pb_utils.MetricFamily.HISTOGRAM}
    return pb_utils.MetricFamily(name, description, kinds[kind])


def lora_name(request) -> str | None:
    """The adapter's name a client gave in the request's parameters (the OpenAI frontend does), for the metrics."""
    try:
        name = json.loads(request.parameters() or "{}").get("lora_name")
    except (AttributeError, ValueError):
        return None
    return name if isinstance(name, str) and 0 < len(name) <= 128 else None


def check_unary(rows) -> None:
    """Without decoupled mode a request gets exactly one response: its rows' outputs together, not streamed."""
    if any(row.streaming for row in rows):
        raise RequestError("streaming", "streaming is only supported in decoupled mode")
    if any(row.params.num_return_sequences > 1 and row.params.beam_width == 1 for row in rows):
        raise RequestError("num_return_sequences", "several sequences of a prompt need decoupled mode (one "
                                                   "response each)")


class TritonPythonModel:
    def initialize(self, args):
        self.watchdog = watchdog()                 # a killed tritonserver leaves no stub behind
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.metrics = ServerMetrics(metric_family, {"model": args["model_name"], "version": args["model_version"]})
        kwargs = engine_kwargs(config)
        check_period_ms = kwargs.pop("cancellation_check_period_ms", 100)
        steps_behind = kwargs.pop("responder_steps_behind", None)
        self.engine = EngineClient(kwargs, args["model_name"], args["model_instance_name"],
                                   check_period_s=check_period_ms / 1e3, steps_behind=steps_behind,
                                   on_report=self.metrics.show, on_broken=self.metrics.show_broken)
        self.heartbeat = Heartbeat(self.metrics.beat, lambda: self.engine.alive, lambda: None).start()

    def execute(self, requests):
        for request in requests:                   # every request is answered, whatever happens to the others
            try:
                self._accept(request)
            except RequestError as err:
                TritonStream(request, [], self.metrics).fail(str(err))
            except Exception as err:
                TritonStream(request, [], self.metrics).fail(f"request failed: {type(err).__name__}: {err}")
        return None

    def _accept(self, request) -> None:
        inputs = request.inputs()
        check_declared({t.name(): t.shape() for t in inputs}, self.engine.limits)    # before any data is read
        rows = parse_request({t.name(): as_array(t) for t in inputs}, self.engine.limits)
        name = lora_name(request)
        for row in rows:
            row.lora = row.lora.named(name) if row.lora is not None and name else row.lora
        if not self.decoupled:
            check_unary(rows)
        stream = TritonStream(request, rows, self.metrics, unary=not self.decoupled)
        if rows[0].stop:
            self._stop(request.request_id(), stream)
        else:
            self.engine.submit(stream, request.request_id())

    def _stop(self, name: str, stream: TritonStream) -> None:
        if not name:
            stream.fail("A request id must be provided for request cancellation")
            return
        self.engine.cancel(name)
        stream.acknowledge()

    def finalize(self):
        self.heartbeat.stop()
        self.engine.close()                        # the engine's process ends with its last stub (a model unload)
        self.metrics.close()
        end_stub()

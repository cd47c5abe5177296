"""Triton Python backend adapter for the engine: tensors in, backend requests out, responses back.

No scheduling, model math, LoRA parsing or response assembly here: `execute` parses and sends each request to the
engine's process (backend/serving/engine_process.py, started by the instance's first stub and kept when a stub dies),
then returns at once; its answers come back on the client's answering thread (backend/serving/engine_client.py), are
assembled into each response's arrays (backend/serving/responses.py) and sent as tensors through the request's sender.
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from backend.config import as_bool                                  # noqa: E402
from backend.core.request import RequestError                       # noqa: E402
from backend.processes import end_stub, watchdog                    # noqa: E402
from backend.serving.engine_client import EngineClient              # noqa: E402
from backend.serving.engine_process import RESTARTS_PARAMETER       # noqa: E402
from backend.serving.heartbeat import SERVER_CALL_S, Heartbeat, InFlight  # noqa: E402
from backend.serving.metrics import ServerMetrics                   # noqa: E402
from backend.serving.protocol import check_declared, parse_request  # noqa: E402
from backend.serving.responses import ResponseStream, check_unary   # noqa: E402

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
PATH_PARAMS = ("model_dir", "lora_prefetch_dir", "tokenizer_dir", "inject_stuck_call_file")


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
            value = as_bool(value)
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


CALLS = InFlight()                                 # this stub's calls into tritonserver, watched by its heartbeat


class TritonSender:
    """A request's response sender as backend/serving/responses.py's ResponseStream uses it: arrays in, tensors out."""

    def __init__(self, request):
        self.sender = request.get_response_sender()

    def send(self, arrays: dict[str, np.ndarray], final: bool) -> None:
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])
        with CALLS.call():
            self.sender.send(response, flags=FINAL if final else 0)

    def send_error(self, message: str) -> None:
        with CALLS.call():
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)

    def is_cancelled(self) -> bool:
        with CALLS.call():
            return self.sender.is_cancelled()


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


class TritonPythonModel:
    def initialize(self, args):
        self.watchdog = watchdog()                 # a killed tritonserver leaves no stub behind
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.metrics = ServerMetrics(metric_family, {"model": args["model_name"], "version": args["model_version"]})
        kwargs = engine_kwargs(config)
        check_period_ms = kwargs.pop("cancellation_check_period_ms", 100)
        steps_behind = kwargs.pop("responder_steps_behind", None)
        CALLS.stuck_file = kwargs.pop("inject_stuck_call_file", None)
        self.engine = EngineClient(kwargs, args["model_name"], args["model_instance_name"],
                                   check_period_s=check_period_ms / 1e3, steps_behind=steps_behind,
                                   on_report=self.metrics.show, on_broken=self.metrics.show_broken)
        self.heartbeat = Heartbeat(self.metrics.beat, lambda: self.engine.alive, CALLS.oldest, max_step_s=SERVER_CALL_S,
                                   what="a call into tritonserver (a response or a cancellation check)").start()

    def execute(self, requests):
        for request in requests:                   # every request is answered, whatever happens to the others
            try:
                self._accept(request)
            except RequestError as err:
                ResponseStream(TritonSender(request), [], self.metrics).fail(str(err))
            except Exception as err:
                ResponseStream(TritonSender(request), [], self.metrics).fail(
                    f"request failed: {type(err).__name__}: {err}")
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
        stream = ResponseStream(TritonSender(request), rows, self.metrics, unary=not self.decoupled)
        if rows[0].stop:
            self._stop(request.request_id(), stream)
        else:
            self.engine.submit(stream, request.request_id())

    def _stop(self, name: str, stream: ResponseStream) -> None:
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

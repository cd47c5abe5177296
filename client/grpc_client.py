"""A streaming gRPC client for the lora_llm model, speaking TensorRT-LLM backend's tensors."""
import asyncio
import queue
from pathlib import Path
from typing import Iterator

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from backend.serving.heartbeat import core_key_headers

NOT_FOUND = "not found in cache. Please send LoRA weights with request"
DATATYPES = {np.bool_: "BOOL", np.int32: "INT32", np.uint64: "UINT64", np.float32: "FP32", np.float16: "FP16",
             np.object_: "BYTES"}


def input_arrays(input_ids: list[int], max_tokens: int, streaming: bool = True, lora_task_id: int | None = None,
                 lora_weights: np.ndarray | None = None, lora_config: np.ndarray | None = None,
                 **scalars) -> dict[str, np.ndarray]:
    """Inputs shaped as TensorRT-LLM backend clients shape them: [1, L], [1, 1], [1, N, R], [1, N, 3].
    scalars: end_id, temperature, runtime_top_k, runtime_top_p, seed, ... (None values are left out)."""
    dtypes = {"temperature": np.float32, "runtime_top_p": np.float32, "repetition_penalty": np.float32,
              "presence_penalty": np.float32, "frequency_penalty": np.float32, "seed": np.uint64,
              "random_seed": np.uint64, "lora_task_id": np.uint64, "streaming": np.bool_, "stop": np.bool_,
              "return_log_probs": np.bool_, "exclude_input_in_output": np.bool_}
    arrays = {"input_ids": np.array([input_ids], dtype=np.int32),
              "request_output_len": np.array([[max_tokens]], dtype=np.int32),
              "streaming": np.array([[streaming]], dtype=np.bool_)}
    for name, value in (scalars | {"lora_task_id": lora_task_id}).items():
        if value is not None:
            arrays[name] = np.array([[value]], dtype=dtypes.get(name, np.int32))
    if lora_weights is not None:
        arrays["lora_weights"] = np.asarray(lora_weights, dtype=np.float16).reshape(1, *lora_weights.shape[-2:])
        config = np.asarray(lora_config, dtype=np.int32)
        arrays["lora_config"] = config.reshape(1, -1, config.shape[-1])                    # 3 columns, or 4 (DoRA)
    return arrays


def build_inputs(input_ids: list[int], max_tokens: int, streaming: bool = True, lora_task_id: int | None = None,
                 lora_weights: np.ndarray | None = None, lora_config: np.ndarray | None = None,
                 **scalars) -> list[grpcclient.InferInput]:
    """input_arrays(...) as tritonclient InferInputs."""
    inputs = []
    arrays = input_arrays(input_ids, max_tokens, streaming, lora_task_id, lora_weights, lora_config, **scalars)
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), DATATYPES[array.dtype.type])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def infer_request(model: str, arrays: dict[str, np.ndarray], request_id: str = "",
                  parameters: dict[str, str | bool] | None = None) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest as tritonclient sends one (raw contents, an empty final response asked for), for
    clients that speak the protocol directly (grpc.aio) instead of through tritonclient's threads."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, array in arrays.items():
        request.inputs.add(name=name, datatype=DATATYPES[array.dtype.type], shape=array.shape)
        if array.dtype == np.object_:
            request.raw_input_contents.append(serialize_byte_tensor(array).item())   # length-prefixed strings
        else:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for key, value in (parameters or {}).items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        else:
            request.parameters[key].string_param = value
    return request


RAW_INPUT_CONTENTS = service_pb2.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number


def infer_request_bytes(model: str, arrays: dict[str, np.ndarray], request_id: str = "",
                        parameters: dict[str, str | bool] | None = None,
                        large: dict[str, tuple[str, list[int], bytes]] | None = None) -> bytes:
    """infer_request(...) serialized, with `large` inputs ({name: (datatype, shape, raw bytes)}) appended to the
    wire bytes as they are: a 57 MB adapter costs one copy instead of three (numpy, protobuf, serialization).
    Protobuf's encoding allows it: a repeated field's elements may follow the rest of the message."""
    request = infer_request(model, arrays, request_id, parameters)
    tail = []
    for name, (datatype, shape, raw) in (large or {}).items():
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        tail += [_varint(RAW_INPUT_CONTENTS << 3 | 2), _varint(len(raw)), raw]      # tag (length-delimited), length
    return b"".join([request.SerializeToString(), *tail])


async def call_ended(call, timeout_s: float = 1.0) -> None:
    """After a stream's final response, wait (a little) for its status before the call is closed or cancelled:
    tritonserver 2.51 keeps the request of a stream cancelled between the two and then never unloads the model, so
    that it cannot stop (see scripts/server_process.stop_server). grpc.aio calls."""
    try:
        await asyncio.wait_for(call.code(), timeout_s)
    except asyncio.TimeoutError:
        pass


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class LoraLLMClient:
    """Streams token ids from the server. Sends an adapter's weights only the first time in a session, and
    once more if the server answers that it does not have them (evicted, or restarted)."""

    def __init__(self, url: str = "127.0.0.1:8001", model: str = "lora_llm", headers: dict[str, str] | None = None):
        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.headers = core_key_headers("grpc") if headers is None else headers   # the key of an exposed server
        self.sent_task_ids: set[int] = set()

    def close(self) -> None:
        self.client.close()

    def generate(self, input_ids: list[int], max_tokens: int = 64, stream: bool = True,
                 lora_task_id: int | None = None, lora_dir: str | Path | None = None, **scalars) -> Iterator[list[int]]:
        """Yield each response's output_ids (new tokens when streaming; the whole output otherwise)."""
        send_weights = lora_dir is not None and lora_task_id not in self.sent_task_ids
        try:
            yield from self._request(input_ids, max_tokens, stream, lora_task_id, lora_dir if send_weights else None,
                                     **scalars)
        except InferenceServerException as err:
            if lora_dir is None or send_weights or NOT_FOUND not in str(err):
                raise
            yield from self._request(input_ids, max_tokens, stream, lora_task_id, lora_dir, **scalars)
        if lora_task_id is not None:
            self.sent_task_ids.add(lora_task_id)

    def _request(self, input_ids, max_tokens, stream, lora_task_id, lora_dir, **scalars) -> Iterator[list[int]]:
        weights = config = None
        if lora_dir is not None:
            from backend.lora.peft import load_lora_dir
            weights, config = load_lora_dir(lora_dir)
        responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)),
                                 headers=self.headers or None)
        try:
            self.client.async_stream_infer(self.model, build_inputs(input_ids, max_tokens, stream, lora_task_id,
                                                                    weights, config, **scalars),
                                           enable_empty_final_response=True)
            while True:
                result, error = responses.get()
                if error is not None:
                    raise error
                ids = result.as_numpy("output_ids")
                if ids is not None and ids.size:
                    yield ids.reshape(-1).tolist()
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return
        finally:
            self.client.stop_stream()

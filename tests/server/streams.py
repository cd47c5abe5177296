"""Raw gRPC streaming helpers for the server tests (independent of client/, which they also test)."""
import queue
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

TRITON_DTYPES = {np.int32: "INT32", np.uint64: "UINT64", np.float32: "FP32", np.float16: "FP16", np.bool_: "BOOL",
                 np.object_: "BYTES", np.int64: "INT64", np.uint8: "UINT8"}


def make_inputs(**arrays) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in arrays.items():
        array = np.asarray(array)
        tensor = grpcclient.InferInput(name, list(array.shape), TRITON_DTYPES[array.dtype.type])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def trtllm_inputs(prompt: list[int], max_tokens: int, streaming: bool, **extra) -> dict:
    """A request shaped as TensorRT-LLM backend clients shape it."""
    arrays = {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
              "request_output_len": np.array([[max_tokens]], np.int32), "streaming": np.array([[streaming]])}
    return arrays | extra


@dataclass
class StreamResult:
    chunks: list[np.ndarray] = field(default_factory=list)     # output_ids of each response
    num_final: int = 0
    error: str | None = None

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.reshape(-1).tolist()]


class Stream:
    """One gRPC stream carrying one request; collects every response until the final flag."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.seen: list = []                                     # responses taken by wait_first, not yet collected
        self.final_at: float | None = None                       # time.monotonic() when the final response arrived
        self.client.start_stream(callback=self._arrived, headers=headers)

    def _arrived(self, result, error) -> None:
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            self.final_at = time.monotonic()
        self.responses.put((result, error))

    def send(self, arrays: dict, model: str = "lora_llm", request_id: str = "",
             parameters: dict | None = None) -> "Stream":
        """The request on the stream. A stream the server ended before the request went out (refused at once: a
        missing key, a model with no healthy stub) raises here in tritonclient instead of answering through the
        callback, depending on which comes first; either way the error is the stream's answer."""
        try:
            self.client.async_stream_infer(model, make_inputs(**arrays), request_id=request_id,
                                           enable_empty_final_response=True, parameters=parameters)
        except grpcclient.InferenceServerException as err:
            try:                                                 # the server's own error, through the callback
                self.seen.append(self.responses.get(timeout=5))
            except queue.Empty:
                self.seen.append((None, err))
        return self

    def collect(self, timeout_s: float = 120, output: str = "output_ids") -> StreamResult:
        result = StreamResult()
        while True:
            response, error = self.seen.pop(0) if self.seen else self.responses.get(timeout=timeout_s)
            if error is not None:
                result.error = str(error)
                result.num_final += 1
                return result
            array = response.as_numpy(output)
            if array is not None and array.size:
                result.chunks.append(array)
            if response.get_response().parameters["triton_final_response"].bool_param:
                result.num_final += 1
                return result

    def results(self, timeout_s: float = 120) -> list:
        """Every response (InferResult) up to the final one; an error response raises."""
        out = []
        while True:
            response, error = self.seen.pop(0) if self.seen else self.responses.get(timeout=timeout_s)
            if error is not None:
                raise RuntimeError(str(error))
            out.append(response)
            if response.get_response().parameters["triton_final_response"].bool_param:
                return out

    def wait_first(self, timeout_s: float = 60) -> None:
        """Block until the first response has arrived (collect still sees it)."""
        self.seen.append(self.responses.get(timeout=timeout_s))

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def run(url: str | Stream, arrays: dict, model: str = "lora_llm", request_id: str = "",
        output: str = "output_ids", headers: dict[str, str] | None = None) -> StreamResult:
    """One request on a new stream (or on `url` when it is an open Stream), collected and closed."""
    stream = (url if isinstance(url, Stream) else Stream(url, headers)).send(arrays, model, request_id)
    try:
        return stream.collect(output=output)
    finally:
        stream.close()


def send_lie(url: str, name: str, datatype: str, shape: list[int], model: str = "lora_llm", data: bytes = b"",
             headers: dict[str, str] | None = None) -> str:
    """A request whose input `name` declares `shape` but carries `data` (none by default: a shape whose byte count
    wraps around 64 bits passes tritonserver's size check); the error it got (an error response, or the stream cut
    where tritonserver itself went down: either way the client knows), or "" for a normal final response."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    from client.grpc_client import infer_request
    request = infer_request(model, trtllm_inputs([5, 6, 7], 2, True))
    tensor = next((t for t in request.inputs if t.name == name), None)
    if tensor is None:
        tensor = request.inputs.add(name=name)
        request.raw_input_contents.append(b"")
    index = list(request.inputs).index(tensor)
    tensor.datatype = datatype
    del tensor.shape[:]
    tensor.shape.extend(shape)
    request.raw_input_contents[index] = data
    with grpc.insecure_channel(url) as channel:
        try:
            for response in service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                    iter([request]), timeout=60, metadata=tuple((headers or {}).items()) or None):
                return response.error_message
        except grpc.RpcError as err:        # tritonserver 2.51 itself went down with the stub: the stream is cut
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return f"the stream was cut: {err.details()}"
    return ""


def running_stream(url: str, arrays: dict, is_running, attempts: int = 3, before=None) -> Stream:
    """A stream whose request is seen running: `is_running()` (a metric, gauges go out every 0.1 s while steps run)
    held before its final response. A short request can finish before that on a loaded machine (400 tokens of the
    tiny model take ~0.6 s); it is then sent again, `attempts` times at most. before: called before each send (to
    read a counter's figure from before the request that ran)."""
    for _ in range(attempts):
        if before is not None:
            before()
        stream = Stream(url).send(arrays)
        stream.wait_first()
        while stream.final_at is None:
            if is_running():
                return stream
            time.sleep(0.02)
        stream.close()
    raise AssertionError(f"the request finished before it was seen running, {attempts} times")

"""The core model over tritonserver's gRPC streaming API: one stream per request, tokens as they are made.

Speaks the protocol through grpc.aio on one channel (tritonclient's threaded client costs ~0.5 ms of CPU a streamed
token). Closing a request's stream early (a client gone, every choice stopped) cancels it in the core, which frees
its KV blocks at its next cancellation check.
"""
import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

from backend.serving.heartbeat import core_key_headers
from client.grpc_client import NOT_FOUND, call_ended, infer_request, infer_request_bytes
from frontend.adapters import Adapter
from frontend.errors import OpenAIError, from_core
from frontend.metrics import UPLOADS
from frontend.tensors import AdapterInvalid

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
READY = "/inference.GRPCInferenceService/ModelReady"
# Messages of any size (adapter uploads); after an outage, a connection tried every 0.1-1 s rather than with gRPC's
# default backoff (1 s growing to 120 s: the API reached a restarted tritonserver 12-18 s after it listened).
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
log = logging.getLogger("frontend.core")


@dataclass(slots=True)
class ScoredPrompt:
    """The prompt's log probs as the core returns them (return_prompt_log_probs): position i is token i given those
    before it; position 0 has none (NaN, rank 0, no alternatives)."""
    log_probs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]                  # [P][k]
    top_log_probs: list[list[float]]


@dataclass(slots=True)
class CoreChunk:
    """New tokens of one sequence of a request (sequence_index: which of its num_return_sequences)."""
    sequence_index: int
    token_ids: list[int]
    log_probs: list[float]
    top_ids: list[list[int]] = field(default_factory=list)           # by token: its top alternatives
    top_log_probs: list[list[float]] = field(default_factory=list)
    prompt: ScoredPrompt | None = None        # with a request's first tokens, when asked for


class CoreClient:
    def __init__(self, url: str, model: str = "lora_llm"):
        self.url = url
        self.model = model
        self.metadata = tuple(core_key_headers("grpc").items()) or None   # where tritonserver's ports ask for a key
        self.channel = grpc.aio.insecure_channel(url, options=CHANNEL_OPTIONS)
        self.stream = self.channel.stream_stream(STREAM, response_deserializer=
                                                 service_pb2.ModelStreamInferResponse.FromString)
        self.model_ready = self.channel.unary_unary(READY, response_deserializer=
                                                    service_pb2.ModelReadyResponse.FromString)

    async def close(self) -> None:
        await self.channel.close()

    async def ready(self) -> bool:
        try:
            request = service_pb2.ModelReadyRequest(name=self.model)
            return (await self.model_ready(request.SerializeToString(), timeout=5)).ready
        except grpc.aio.AioRpcError:
            return False

    async def generate(self, arrays: dict[str, np.ndarray], adapter: Adapter | None = None,
                       request_id: str = "") -> AsyncIterator[CoreChunk]:
        """Stream a request's tokens. An adapter's weights go with its first request, and once more if the core
        answers that it no longer holds them (the TensorRT-LLM client habit)."""
        resent = False
        while True:
            upload = await adapter.begin() if adapter is not None else None
            try:
                request = await self._request(arrays, adapter, upload is not None, request_id)
                async for chunk in self._stream(request, adapter, upload):
                    yield chunk
                return
            except AdapterNotFound as err:
                if resent:
                    raise from_core(str(err)) from None
                adapter.forget()
                resent = True
            finally:
                if upload is not None:
                    adapter.end(upload, accepted=False)    # no answer came: the next request uploads again

    async def _request(self, arrays: dict, adapter: Adapter | None, carries: bool, request_id: str) -> bytes:
        arrays = dict(arrays)
        parameters = {}
        if adapter is not None:
            arrays["lora_task_id"] = np.array([[adapter.task_id]], np.uint64)
            parameters["lora_name"] = adapter.name
        if not carries:
            return infer_request(self.model, arrays, request_id, parameters).SerializeToString()
        try:
            prepared = await adapter.inputs()
        except AdapterInvalid as err:                  # a store adapter read on first use
            raise OpenAIError(500, f"adapter '{adapter.name}' cannot be served: {err}", "InternalServerError",
                              code="adapter_invalid") from None
        arrays["lora_config"] = prepared.config
        return infer_request_bytes(self.model, arrays, request_id, parameters,
                                   large={"lora_weights": ("FP16", prepared.weights_shape, prepared.weights)})

    async def _stream(self, request: bytes, adapter: Adapter | None,
                      upload: asyncio.Future | None) -> AsyncIterator[CoreChunk]:
        call = self.stream(metadata=self.metadata)
        try:
            await call.write(request)
            await call.done_writing()
            if upload is not None:                         # on the wire: the adapter's other requests may follow
                adapter.end(upload, accepted=True)         # (one that overtakes it is answered "not found", sent again)
                UPLOADS.labels(adapter.name).inc()
            async for response in call:
                if response.error_message:
                    if upload is not None:
                        adapter.forget()                   # the core refused the weights: the next request sends them
                    if NOT_FOUND in response.error_message:
                        raise AdapterNotFound(response.error_message)
                    raise from_core(response.error_message)
                result = response.infer_response
                for chunk in parse(result):
                    if chunk.token_ids:
                        yield chunk
                if result.parameters["triton_final_response"].bool_param:
                    await call_ended(call)
                    return
            raise OpenAIError(503, "the core model closed its stream before the final response",
                              "ServiceUnavailableError", code="service_unavailable")
        except grpc.aio.AioRpcError as err:                # its details name internal addresses: logged, not sent
            log.warning("core stream failed: %s: %s", err.code().name, err.details())
            raise OpenAIError(503, f"the core model is unavailable ({err.code().name})", "ServiceUnavailableError",
                              code="service_unavailable") from None
        finally:
            call.cancel()                              # no-op once it ended; cancels the request in the core otherwise


class AdapterNotFound(Exception):
    pass


def parse(result: service_pb2.ModelInferResponse) -> list[CoreChunk]:
    """A response's chunks: one, or under beam search one per beam (output_ids [1, beams, n], each beam's tokens
    up to its sequence_length)."""
    outputs = {out.name: (out.shape, raw) for out, raw in zip(result.outputs, result.raw_output_contents)}

    def array(name: str, dtype) -> np.ndarray:
        shape, raw = outputs.get(name, ((0,), b""))
        return np.frombuffer(raw, dtype=dtype).reshape(shape)

    ids = array("output_ids", np.int32)
    if ids.ndim == 3 and ids.shape[1] > 1:
        lengths = array("sequence_length", np.int32).reshape(-1)
        return [CoreChunk(beam, ids[0, beam, :n].tolist(), []) for beam, n in enumerate(lengths.tolist())]
    return [parse_one(array, outputs)]


def parse_one(array, outputs: dict) -> CoreChunk:
    index = array("sequence_index", np.int32).reshape(-1)
    chunk = CoreChunk(int(index[0]) if index.size else 0, array("output_ids", np.int32).reshape(-1).tolist(),
                      array("output_log_probs", np.float32).reshape(-1).tolist())
    if "output_top_log_probs" in outputs:                          # [1, 1, tokens, k]
        chunk.top_ids = array("output_top_log_prob_ids", np.int32)[0, 0].tolist()
        chunk.top_log_probs = array("output_top_log_probs", np.float32)[0, 0].tolist()
    if "prompt_log_probs" in outputs:                              # [1, prompt] and [1, prompt, k]
        log_probs = array("prompt_log_probs", np.float32)[0]
        none = [[] for _ in log_probs]                             # no alternatives asked for
        top_ids, top_log_probs = none, none
        if "prompt_top_log_probs" in outputs:
            top_ids = array("prompt_top_log_prob_ids", np.int32)[0].tolist()
            top_log_probs = array("prompt_top_log_probs", np.float32)[0].tolist()
        chunk.prompt = ScoredPrompt(log_probs.tolist(), array("prompt_log_prob_ranks", np.int32)[0].tolist(), top_ids,
                                    top_log_probs)
    return chunk

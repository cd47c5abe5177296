"""The benchmarks' gRPC client: streams through tritonserver's ModelStreamInfer with as little client CPU as it can,
since on a small machine the client shares the cores with the server it measures. One asyncio thread and one
channel for every stream, requests serialized before the clock starts, responses read straight from their
protobufs (tritonclient's threaded client spends ~0.5 ms of CPU a streamed token, and ~0.3 s a 57 MB upload)."""
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

from client.grpc_client import NOT_FOUND, call_ended, infer_request

METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def serialize_request(model: str, arrays: dict[str, np.ndarray]) -> bytes:
    """A ModelInferRequest on the wire, as tritonclient sends one (raw contents, an empty final response asked)."""
    return infer_request(model, arrays).SerializeToString()


@dataclass
class Prepared:
    """One request as sent: its bytes, its adapter, whether it carries the adapter's weights, and what makes it
    again with the weights should the server not have them (evicted, or an upload that failed)."""
    request: bytes
    lora_task_id: int | None = None
    uploads: bool = False
    with_weights: Callable[[], bytes] | None = None


@dataclass
class StreamStats:
    """What the client saw: token counts and times, per request and overall."""
    num_tokens: int = 0
    num_responses: int = 0                         # with tokens: fewer than the tokens where the server merged steps
    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    resends: int = 0                               # requests the server answered "not found": sent with weights


async def _one(stub, index: int, request: bytes, stats: StreamStats, on_tokens,
               written: asyncio.Event | None = None) -> str | None:
    """Request `index` on a stream of its own; its error message, or None once its final response came.
    `written` is set once the request is on the wire (or failed)."""
    call = stub()
    t0 = time.perf_counter()
    last = None
    try:
        await call.write(request)
        await call.done_writing()
    finally:
        if written is not None:
            written.set()
    async for response in call:
        if response.error_message:
            call.cancel()
            return response.error_message
        result = response.infer_response
        now = time.perf_counter()
        for output, raw in zip(result.outputs, result.raw_output_contents):
            if output.name == "output_ids" and raw:
                ids = np.frombuffer(raw, dtype=np.int32)
                stats.num_tokens += ids.size
                stats.num_responses += 1
                on_tokens(index, ids)
                if last is None:
                    stats.ttfts.append(now - t0)
                else:
                    stats.gaps.append(now - last)
                last = now
        if result.parameters["triton_final_response"].bool_param:
            await call_ended(call)
            return None
    return "stream closed before the final response"


async def stream_requests(url: str, requests: list[Prepared], concurrency: int,
                          on_tokens: Callable[[int, np.ndarray], None] = lambda index, ids: None) -> StreamStats:
    """Send `requests` over `concurrency` streams at once, in order. A request that uses an adapter another one
    uploads waits until that upload has been written: on one channel a small request would overtake a 57 MB upload
    and be answered "not found". One so answered anyway is sent again with the weights, as TensorRT-LLM clients
    do. on_tokens(index, ids): each response's new token ids."""
    stats = StreamStats()
    todo = list(reversed(list(enumerate(requests))))
    uploaded = {r.lora_task_id: asyncio.Event() for r in requests if r.uploads}
    async with grpc.aio.insecure_channel(url, options=UNLIMITED) as channel:
        stub = channel.stream_stream(METHOD, response_deserializer=service_pb2.ModelStreamInferResponse.FromString)

        async def worker() -> None:
            while todo:
                index, r = todo.pop()
                if not r.uploads and r.lora_task_id in uploaded:
                    await uploaded[r.lora_task_id].wait()
                error = await _one(stub, index, r.request, stats, on_tokens,
                                   uploaded[r.lora_task_id] if r.uploads else None)
                if error and NOT_FOUND in error and r.with_weights is not None:
                    stats.resends += 1
                    error = await _one(stub, index, r.with_weights(), stats, on_tokens)
                if error:
                    raise RuntimeError(error)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return stats

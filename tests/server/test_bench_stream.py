"""bench/stream.py, the benchmarks' lean gRPC client, against a real tritonserver: the tokens it counts are
the engine's, a request the server answers "not found" is sent again with its adapter, an error stops the run, and a
stream read to its final response is left once its status came (never cancelled: see client.grpc_client.call_ended)."""
import asyncio
from functools import partial

import grpc
import pytest
from tritonclient.grpc import service_pb2

from backend.lora.peft import peft_to_trtllm
from client.grpc_client import call_ended, input_arrays
from tests.helpers import random_prompts

from bench.stream import METHOD, Prepared, serialize_request, stream_requests

MAX_NEW = 6


@pytest.fixture(scope="module")
def adapters(tiny_adapters):
    return {task_id: peft_to_trtllm(path, "float16") for task_id, path in zip((301, 302), tiny_adapters)}


@pytest.fixture(scope="module")
def engine(new_tiny_engine, adapters):
    """The in-process engine the tiny server runs, with both adapters, for the reference tokens."""
    engine = new_tiny_engine()
    for task_id, (weights, config) in adapters.items():
        engine.add_lora(task_id, weights, config)
    return engine


def request(prompt: list[int], task_id: int | None = None, adapter=None) -> bytes:
    weights, config = adapter or (None, None)
    return serialize_request("lora_llm", input_arrays(prompt, MAX_NEW, True, task_id, weights, config))


@pytest.mark.parametrize("concurrency", [1, 3])
def test_streams_the_engine_tokens_and_resends_on_not_found(tiny_server, engine, adapters, concurrency):
    task_ids = [None, 301, 301, 302, None]
    prompts = random_prompts([5, 9, 14, 7, 20], 512, seed=50 + concurrency)
    want = engine.generate(prompts, max_new_tokens=MAX_NEW, lora_task_ids=task_ids)
    offset = 10 * concurrency                        # task ids of this run only: the server keeps what it was sent
    first, second = 301 + offset, 302 + offset
    requests = [Prepared(request(prompts[0])),
                Prepared(request(prompts[1], first, adapters[301]), first, uploads=True),
                Prepared(request(prompts[2], first), first,
                         with_weights=partial(request, prompts[2], first, adapters[301])),
                Prepared(request(prompts[3], second), second,                # never sent: "not found", then again
                         with_weights=partial(request, prompts[3], second, adapters[302])),
                Prepared(request(prompts[4]))]
    got = [[] for _ in requests]
    stats = asyncio.run(stream_requests(tiny_server.grpc_url, requests, concurrency,
                                        lambda index, ids: got[index].extend(ids.tolist())))
    assert got == want
    assert stats.num_tokens == len(requests) * MAX_NEW
    assert len(stats.ttfts) == len(requests)         # a gap a response: a token each, or a few where the server's
    assert len(requests) <= len(stats.gaps) <= len(requests) * (MAX_NEW - 1)      # sends fell behind its steps
    assert 1 <= stats.resends <= 2                  # the second adapter; the first only had it overtaken its upload


def test_an_error_response_stops_the_run_with_its_message(tiny_server):
    bad = serialize_request("lora_llm", input_arrays([1, 2, 3], MAX_NEW, True, 999_001))
    with pytest.raises(RuntimeError, match="LoRA task 999001 not found in cache"):
        asyncio.run(stream_requests(tiny_server.grpc_url, [Prepared(bad, 999_001)], 1))


def test_a_stream_read_to_its_final_response_ends_with_its_status_not_a_cancel(tiny_server):
    async def final_then_ended() -> tuple[bool, bool, grpc.StatusCode]:
        async with grpc.aio.insecure_channel(tiny_server.grpc_url) as channel:
            call = channel.stream_stream(METHOD, response_deserializer=service_pb2.ModelStreamInferResponse.FromString)()
            await call.write(request(random_prompts([6], 512, seed=52)[0]))
            await call.done_writing()
            async for response in call:
                if response.infer_response.parameters["triton_final_response"].bool_param:
                    break
            await call_ended(call)
            return call.done(), call.cancelled(), await call.code()

    assert asyncio.run(final_then_ended()) == (True, False, grpc.StatusCode.OK)

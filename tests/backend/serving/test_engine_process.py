"""The engine's process (backend/serving/engine_process.py) and a stub's side of it (backend/serving/engine_client.py):
a stub that connects hears "ready" first, however long its hello takes, and not a heartbeat meant for the stubs already
served (a new stub that read a beat as its reply failed to start, and so did its tritonserver, once in a CI run); a
sender slower than the engine gets several steps' tokens in one answer, every token in order."""
import os
import socket
import time

import numpy as np
from transformers import AutoModelForCausalLM

from backend.serving.channel import Channel
from backend.serving.engine_client import EngineClient, socket_path
from backend.serving.heartbeat import PERIOD_S
from tests.backend.serving.loop_streams import FakeStream
from tests.helpers import hf_greedy, random_prompts


def test_a_stub_hears_ready_first_however_long_its_hello_takes(tiny_model_dir):
    kwargs = {"model_dir": str(tiny_model_dir), "dtype": "float32", "kernel_backend": "torch",
              "kv_cache_memory_bytes": 1 << 20}
    first = EngineClient(kwargs, "lora_llm", "handshake_test_0")          # starts the engine's process
    late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    late.connect(str(socket_path(os.getppid(), "handshake_test_0", kwargs)))
    channel = Channel(late)
    try:
        time.sleep(4 * PERIOD_S)                                          # beats go out to the first stub meanwhile
        channel.send(("hello", os.getpid(), os.getppid(), ""))
        reply = channel.recv()
        assert reply[0] == "ready", f"the first message after hello was {reply[0]!r}"
        channel.send(("goodbye",))
    finally:
        channel.close()
        first.close()
    first.process.wait(timeout=30)                                        # the last stub said goodbye


class SlowStream(FakeStream):
    """A sender as slow as tritonserver's under load: 3 ms a response."""

    def emit(self, out, batch_index: int, last: bool) -> None:
        time.sleep(0.003)
        super().emit(out, batch_index, last)


def test_a_slow_sender_gets_several_steps_tokens_in_one_answer(tiny_model_dir):
    """Eight streams of 24 tokens through a sender 3 ms a response, slower than the tiny model's steps: the answers
    queued behind it are merged per stream (fewer answers than tokens), and every stream gets transformers' greedy
    tokens, in order, with one final answer."""
    kwargs = {"model_dir": str(tiny_model_dir), "dtype": "float32", "kernel_backend": "torch",
              "kv_cache_memory_bytes": 4 << 20}
    prompts = random_prompts([5 + 3 * i for i in range(8)], 256, seed=5)
    client = EngineClient(kwargs, "lora_llm", "merge_test_0")
    try:
        streams = [SlowStream(p, max_new_tokens=24, streaming=np.array([[True]])) for p in prompts]
        for stream in streams:
            client.submit(stream)
        for stream in streams:
            stream.wait()
    finally:
        client.close()
    client.process.wait(timeout=30)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype="float32")
    for prompt, stream in zip(prompts, streams):
        assert stream.answers == ["finish"]
        assert stream.tokens == hf_greedy(model, prompt, 24)
    num_tokens, num_answers = sum(len(s.tokens) for s in streams), sum(s.num_emits for s in streams)
    assert num_answers < 0.75 * num_tokens, f"{num_answers} answers for {num_tokens} tokens: none merged"


def test_a_stub_that_stops_reading_is_let_go_before_its_queue_grows_without_bound(monkeypatch):
    """What waits for a stub is bounded: a stub that reads nothing (stopped, stuck) is let go once MAX_OUTBOX
    messages wait for it (here 8): its streams read as cancelled and its connection closes."""
    from backend.serving import engine_process
    monkeypatch.setattr(engine_process, "MAX_OUTBOX", 8)
    ours, theirs = socket.socketpair()
    stub = engine_process.StubConnection(host=None, channel=Channel(ours))     # no writer: nothing is sent
    for beat in range(7):
        stub.send(("beat", beat))
    assert not stub.gone and len(stub.outbox) == 7
    stub.send(("beat", 7))
    assert stub.gone and stub.outbox == []
    stub.send(("beat", 8))                                                    # a lost stub queues nothing
    assert stub.outbox == []
    theirs.settimeout(5)
    assert theirs.recv(1) == b""                                              # the stub sees its connection end
    theirs.close()

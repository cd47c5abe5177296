"""The engine's process (backend/engine_process.py) and a stub's handshake with it: a stub that connects hears
"ready" first, however long its hello takes, and not a heartbeat meant for the stubs already served (a new stub
that read a beat as its reply failed to start, and so did its tritonserver, once in a CI run)."""
import os
import socket
import time

from backend.channel import Channel
from backend.engine_client import EngineClient, socket_path
from backend.heartbeat import PERIOD_S


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
